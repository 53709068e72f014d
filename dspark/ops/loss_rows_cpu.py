"""The fused loss's per-row work on the CPU in one C++ pass per row (dspark.ops.fused_loss's chunk loop).

The torch chunk loop runs ~15 elementwise passes over [chunk, V] float32 buffers per chunk (the bf16 GEMM output
copied to float32, max, exp, sums, scale, q - p, |.|, sign, q * s, the gradient's addcmul and mul, its copy back
to bf16), each over a buffer far larger than the caches. Here each row is read from the GEMM outputs once into a
float32 row buffer that stays in L2 and finished there: the draft's max / argmax / label logit, exp and sum (ce),
the teacher's the same, then q, p, |q - p| (l1), sign, c = sum q sign, and the gradient of the draft logits

    dd = a q - a onehot(label) + b q (sign(q - p) - c)          (dspark.ops.fused_loss's formula)

written over the draft GEMM's output row in its own dtype, ready for the gradient GEMMs. The math is the
reference's in float32; only the order of the sums differs (and ties of the argmax resolve to the first index, as
torch's max does).
"""
from __future__ import annotations

import torch

from dspark.ops.cpu_kernels import load_cpu_kernel

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

static inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }
static inline float to_f(float v) { return v; }

// d [m, V] draft logits (+ d2, the Markov GEMM's output, when given); t [m, V] teacher logits or none;
// out: ce, l1, d_arg, t_arg [m]; with grads, dd overwrites d in d's dtype.
template <typename T>
static void rows(T* d, const T* d2, const T* t, const int64_t* labels, const float* a, const float* b,
                 float* ce, float* l1, int64_t* d_arg, int64_t* t_arg, int64_t m, int64_t V, bool grads) {
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(V), p(V);
    for (int64_t i = begin; i < end; ++i) {
      T* di = d + i * V;
      const T* d2i = d2 ? d2 + i * V : nullptr;
      if (d2i) for (int64_t v = 0; v < V; ++v) q[v] = to_f(di[v]) + to_f(d2i[v]);
      else for (int64_t v = 0; v < V; ++v) q[v] = to_f(di[v]);
      float mx = q[0];
      for (int64_t v = 1; v < V; ++v) mx = q[v] > mx ? q[v] : mx;
      int64_t arg = 0;
      while (arg + 1 < V && q[arg] != mx) ++arg;  // the first index of the max, as torch.max
      d_arg[i] = arg;
      const int64_t lab = labels[i];
      const float d_lab = q[lab];
      float z = 0.f;
      for (int64_t v = 0; v < V; ++v) { q[v] = std::exp(q[v] - mx); z += q[v]; }
      ce[i] = std::log(z) + mx - d_lab;
      const float inv_z = 1.f / z;
      for (int64_t v = 0; v < V; ++v) q[v] *= inv_z;
      const float ai = a[i];
      if (!t) {
        l1[i] = NAN;
        t_arg[i] = -1;
        if (grads) {
          for (int64_t v = 0; v < V; ++v) di[v] = static_cast<T>(ai * q[v]);
          di[lab] = static_cast<T>(ai * q[lab] - ai);
        }
        continue;
      }
      const T* ti = t + i * V;
      for (int64_t v = 0; v < V; ++v) p[v] = to_f(ti[v]);
      float tmx = p[0];
      for (int64_t v = 1; v < V; ++v) tmx = p[v] > tmx ? p[v] : tmx;
      int64_t targ = 0;
      while (targ + 1 < V && p[targ] != tmx) ++targ;
      t_arg[i] = targ;
      float zt = 0.f;
      for (int64_t v = 0; v < V; ++v) { p[v] = std::exp(p[v] - tmx); zt += p[v]; }
      const float inv_zt = 1.f / zt;
      float l1_sum = 0.f, c = 0.f;
      for (int64_t v = 0; v < V; ++v) {  // p becomes sign(q - p)
        const float diff = q[v] - p[v] * inv_zt;
        const float s = static_cast<float>((diff > 0.f) - (diff < 0.f));
        l1_sum += std::fabs(diff);
        c += q[v] * s;
        p[v] = s;
      }
      l1[i] = l1_sum;
      if (grads) {
        const float bi = b[i];
        for (int64_t v = 0; v < V; ++v) di[v] = static_cast<T>(q[v] * (ai + bi * (p[v] - c)));
        di[lab] = static_cast<T>(q[lab] * (ai + bi * (p[lab] - c)) - ai);
      }
    }
  });
}

void loss_rows(torch::Tensor d, c10::optional<torch::Tensor> d2, c10::optional<torch::Tensor> t, torch::Tensor labels,
               torch::Tensor a, torch::Tensor b, torch::Tensor ce, torch::Tensor l1, torch::Tensor d_arg,
               torch::Tensor t_arg, bool grads) {
  const int64_t m = d.size(0), V = d.size(1);
  TORCH_CHECK(d.is_contiguous() && V > 0, "d: contiguous [m, V]");
  for (const auto& o : {d2, t})
    if (o) TORCH_CHECK(o->is_contiguous() && o->sizes() == d.sizes() && o->scalar_type() == d.scalar_type(),
                       "d2 / t: contiguous, d's shape and dtype");
  TORCH_CHECK(labels.scalar_type() == at::kLong && a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat
              && ce.scalar_type() == at::kFloat && l1.scalar_type() == at::kFloat
              && d_arg.scalar_type() == at::kLong && t_arg.scalar_type() == at::kLong, "row dtypes");
  for (const auto& r : {labels, a, b, ce, l1, d_arg, t_arg})
    TORCH_CHECK(r.is_contiguous() && r.numel() == m, "one contiguous entry per row");
#define DSPARK_ROWS(T) rows<T>(d.data_ptr<T>(), d2 ? d2->data_ptr<T>() : nullptr, t ? t->data_ptr<T>() : nullptr, \
    labels.data_ptr<int64_t>(), a.data_ptr<float>(), b.data_ptr<float>(), ce.data_ptr<float>(), l1.data_ptr<float>(), \
    d_arg.data_ptr<int64_t>(), t_arg.data_ptr<int64_t>(), m, V, grads)
  if (d.scalar_type() == at::kBFloat16) DSPARK_ROWS(at::BFloat16);
  else if (d.scalar_type() == at::kFloat) DSPARK_ROWS(float);
  else TORCH_CHECK(false, "bfloat16 or float32 logits");
#undef DSPARK_ROWS
}
"""


def kernel():
    """The compiled module (``loss_rows``), or None where it cannot be built."""
    return load_cpu_kernel("dspark_loss_rows_v1", _SOURCE, ["loss_rows"], "the torch chunk loop")


def usable(x: torch.Tensor, w: torch.Tensor, teacher_w) -> bool:
    """The kernel covers CPU rows with a bf16 / fp32 head and the teacher over the draft's own ids (not the held-out
    full-vocabulary teacher, nor float64 gradchecks)."""
    return (x.device.type == "cpu" and w.dtype in (torch.bfloat16, torch.float32) and teacher_w is None
            and kernel() is not None)

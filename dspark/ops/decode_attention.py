"""Decode-step attention over per-row KV caches of different lengths (regeneration's native engine).

At decode every row attends over its own cache prefix: per (row, KV head) a [group, head_dim] x [head_dim, len]
product, far too small for a BLAS call each (torch's batched matmul over them ran at ~6 GFLOP/s on one core) and
memory-bound anyway. :func:`decode_attention` is one pass over each row's keys and values at its own length:

* ``decode_attention_reference``: torch ops over the longest row with a mask (any device, any dtype);
* the CPU kernel: a small C++ loop compiled on first use with torch's cpp_extension (``g++``, cached under
  ``$DSPARK_CACHE/torch_extensions``): float32 accumulation, bf16 / fp32 caches, each row read up to its own length.
  Where it cannot be built (no compiler) the reference runs and a warning says so once.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>

// bf16 -> float by bits (vectorises), float stays float
static inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(raw[i]) << 16;
}
static inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

// HD > 0: the head size as a compile-time constant (the inner loops unroll into whole vector registers);
// HD == 0: any head size, read from hd.
template <typename T, int HD>
static void run(const T* q, const T* kc, const T* vc, const int64_t* pos, const int64_t* rows, T* out,
                int64_t n, int64_t kvh, int64_t g, int64_t hd_arg, int64_t max_len, int64_t cache_rows_stride,
                float scale) {
  const int64_t hd = HD > 0 ? HD : hd_arg;
  at::parallel_for(0, n * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * hd), acc(g * hd), s, kf, vf;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / kvh, h = bh % kvh;
      const int64_t len = pos[b] + 1;
      const T* qrow = q + (b * kvh + h) * g * hd;
      const T* kb = kc + rows[b] * cache_rows_stride + h * max_len * hd;
      const T* vb = vc + rows[b] * cache_rows_stride + h * max_len * hd;
      load_row(qrow, qf.data(), g * hd);
      for (int64_t i = 0; i < g * hd; ++i) qf[i] *= scale;
      kf.resize(len * hd);
      load_row(kb, kf.data(), len * hd);  // the row's keys 0..len-1 are contiguous
      s.resize(g * len);
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = qf.data() + j * hd;
        float* sj = s.data() + j * len;
        for (int64_t t = 0; t < len; ++t) {
          const float* kt = kf.data() + t * hd;
          float dot = 0.f;
          for (int64_t d = 0; d < hd; ++d) dot += qj[d] * kt[d];
          sj[t] = dot;
        }
        float mx = sj[0];
        for (int64_t t = 1; t < len; ++t) mx = sj[t] > mx ? sj[t] : mx;
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sj[t] = std::exp(sj[t] - mx); sum += sj[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sj[t] *= inv;
      }
      vf.resize(len * hd);
      load_row(vb, vf.data(), len * hd);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < g; ++j) {
        const float* sj = s.data() + j * len;
        float* aj = acc.data() + j * hd;
        for (int64_t t = 0; t < len; ++t) {
          const float p = sj[t];
          const float* vt = vf.data() + t * hd;
          for (int64_t d = 0; d < hd; ++d) aj[d] += p * vt[d];
        }
      }
      T* orow = out + (b * kvh + h) * g * hd;
      for (int64_t i = 0; i < g * hd; ++i) orow[i] = static_cast<T>(acc[i]);
    }
  });
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor pos,
                               torch::Tensor rows, double scale) {
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous() && pos.is_contiguous()
              && rows.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(pos.size(0) == q.size(0) && rows.size(0) == q.size(0), "one pos and one cache row per query row");
  TORCH_CHECK(rows.numel() == 0 || (rows.min().item<int64_t>() >= 0 && rows.max().item<int64_t>() < kc.size(0)),
              "cache rows out of range");
  TORCH_CHECK(pos.numel() == 0 || (pos.min().item<int64_t>() >= 0 && pos.max().item<int64_t>() < kc.size(2)),
              "positions out of range");
  const int64_t n = q.size(0), kvh = q.size(1), g = q.size(2), hd = q.size(3), max_len = kc.size(2);
  auto out = torch::empty_like(q);
  const int64_t stride = kc.stride(0);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "bfloat16 or float32");
#define DSPARK_RUN(T, HD) run<T, HD>(q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(), pos.data_ptr<int64_t>(), \
                                     rows.data_ptr<int64_t>(), out.data_ptr<T>(), n, kvh, g, hd, max_len, stride, scale)
  if (q.scalar_type() == at::kBFloat16) {
    if (hd == 64) DSPARK_RUN(at::BFloat16, 64); else if (hd == 128) DSPARK_RUN(at::BFloat16, 128);
    else DSPARK_RUN(at::BFloat16, 0);
  } else {
    if (hd == 64) DSPARK_RUN(float, 64); else if (hd == 128) DSPARK_RUN(float, 128); else DSPARK_RUN(float, 0);
  }
#undef DSPARK_RUN
  return out;
}
"""

_kernel = None
_unavailable: str | None = None


def _load():
    """The compiled kernel module, or None (the reason in ``_unavailable``)."""
    global _kernel, _unavailable
    if _kernel is not None or _unavailable is not None:
        return _kernel
    try:
        from torch.utils.cpp_extension import load_inline  # noqa: PLC0415

        root = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark")).expanduser()
        build = root / "torch_extensions" / "decode_attention"
        build.mkdir(parents=True, exist_ok=True)
        _kernel = load_inline("dspark_decode_attention_v4", cpp_sources=_SOURCE, functions=["decode_attention"],
                              extra_cflags=["-O3", "-march=native", "-ffast-math"], build_directory=str(build),
                              verbose=False)
    except Exception as exc:  # noqa: BLE001 (no compiler, no headers: the reference still works)
        _unavailable = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        logger.warning("decode attention: the C++ kernel could not be built (%s); using torch ops (slower)",
                       _unavailable)
    return _kernel


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                               rows: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, kvh, g, hd]; caches [slots, kvh, L, hd]; query row b reads cache row rows[b] at positions 0..pos[b]
    -> [n, kvh, g, hd]."""
    span = int(pos.max()) + 1
    keys, values = k_cache[rows, :, :span], v_cache[rows, :, :span]
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [n, kvh, g, span]
    invalid = torch.arange(span, device=q.device)[None, :] > pos[:, None]  # [n, span]
    scores = scores.masked_fill(invalid[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), values)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Each row's attention over its own cache prefix (shapes as :func:`decode_attention_reference`)."""
    if (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float32) and k_cache.dtype == q.dtype
            and _load() is not None):
        with torch.profiler.record_function("dspark::decode_attention"):
            return _kernel.decode_attention(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                                            pos.to(torch.int64).contiguous(), rows.to(torch.int64).contiguous(),
                                            float(scale))
    return decode_attention_reference(q, k_cache, v_cache, pos, rows, scale)

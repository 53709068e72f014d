"""Decode-step attention over per-row KV caches of different lengths (regeneration's native engine).

At decode every row attends over its own cache prefix: per (row, KV head) a [group, head_dim] x [head_dim, len]
product, far too small for a BLAS call each (torch's batched matmul over them ran at ~6 GFLOP/s on one core) and
memory-bound anyway. :func:`decode_attention` is one pass over each row's keys and values at its own length:

* ``decode_attention_reference``: torch ops over the longest row with a mask (any device, any dtype);
* the CPU kernel: C++ compiled on first use (dspark.ops.cpu_kernels: ``g++``, cached under
  ``$DSPARK_CACHE/torch_extensions``), each row read up to its own length, float32 sums, in the best path this CPU
  has: with AVX512-BF16 and bf16 caches, q.k and p.v as bf16 dot products (``vdpbf16ps``: keys and values never
  widened; the probabilities rounded to bf16 for p.v, as transformers' eager attention casts them), 1.8x the
  float32-widening loop at 600-token rows; with AVX-512, keys / values widened per block of 16 positions and shared
  by the group's query heads; otherwise a plain loop the compiler vectorises. Head sizes 64 and 128 take the vector
  paths. Where it cannot be built (no compiler) the reference runs and a warning says so once.
"""

from __future__ import annotations

import torch

from dspark.ops.cpu_kernels import load_cpu_kernel

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// bf16 -> float by bits (vectorises), float stays float
static inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(raw[i]) << 16;
}
static inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

// s[t] <- exp(s[t] - max s) over one row of scores; returns 1 / their sum (softmax = s * the return value)
static inline float exp_shifted(float* s, int64_t len) {
  float mx = s[0];
  for (int64_t t = 1; t < len; ++t) mx = s[t] > mx ? s[t] : mx;
  float sum = 0.f;
  for (int64_t t = 0; t < len; ++t) { s[t] = std::exp(s[t] - mx); sum += s[t]; }
  return 1.f / sum;
}

#if defined(__AVX512F__)
// AVX-512 path (head size a multiple of 16): keys and values are read once per block of 16 positions, converted to
// float32 into an L1 buffer, and used by every query head of the group; the 16 dot products of a block are summed
// across lanes together (a transpose-add tree), not one horizontal sum each.
static inline __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// the lane sums of a[0..15], in the lane order sum16_lanes() gives
static inline __m512 sum16(__m512 a[16]) {
  __m512 x[8], y[4], z[2];
  for (int k = 0; k < 8; ++k)  // 256-bit halves: lanes 0-7 from a[2k], 8-15 from a[2k+1]
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // 128-bit blocks: a[4k], a[4k+1], a[4k+2], a[4k+3]
    y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // pairs within each block
    z[k] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * k], y[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(y[2 * k], y[2 * k + 1], 0xEE));
  __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
  return w;
}

template <typename T, int HD>
static void run_avx512(const T* q, const T* kc, const T* vc, const int64_t* pos, const int64_t* rows, T* out,
                       int64_t n, int64_t kvh, int64_t g, int64_t max_len, int64_t cache_rows_stride, float scale,
                       const int* lane_of) {
  constexpr int C = HD / 16;
  at::parallel_for(0, n * kvh, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float buf[16 * HD];
    alignas(64) float blk[16];
    std::vector<float> s, acc(g * HD);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / kvh, h = bh % kvh;
      const int64_t len = pos[b] + 1;
      const T* qrow = q + (b * kvh + h) * g * HD;
      const T* kb = kc + rows[b] * cache_rows_stride + h * max_len * HD;
      const T* vb = vc + rows[b] * cache_rows_stride + h * max_len * HD;
      s.resize(g * len);
      for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, len - t0));
        for (int i = 0; i < m; ++i)
          for (int c = 0; c < C; ++c) _mm512_store_ps(buf + i * HD + 16 * c, load16(kb + (t0 + i) * HD + 16 * c));
        for (int64_t j = 0; j < g; ++j) {
          __m512 qv[C], a[16];
          for (int c = 0; c < C; ++c) qv[c] = _mm512_mul_ps(load16(qrow + j * HD + 16 * c), _mm512_set1_ps(scale));
          for (int i = 0; i < 16; ++i) {
            a[i] = _mm512_setzero_ps();
            if (i < m)
              for (int c = 0; c < C; ++c) a[i] = _mm512_fmadd_ps(qv[c], _mm512_load_ps(buf + i * HD + 16 * c), a[i]);
          }
          _mm512_store_ps(blk, sum16(a));
          float* sj = s.data() + j * len + t0;
          for (int i = 0; i < m; ++i) sj[i] = blk[lane_of[i]];
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        float* sj = s.data() + j * len;
        const float inv = exp_shifted(sj, len);
        for (int64_t t = 0; t < len; ++t) sj[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, len - t0));
        for (int i = 0; i < m; ++i)
          for (int c = 0; c < C; ++c) _mm512_store_ps(buf + i * HD + 16 * c, load16(vb + (t0 + i) * HD + 16 * c));
        for (int64_t j = 0; j < g; ++j) {
          const float* pj = s.data() + j * len + t0;
          __m512 av[C];
          for (int c = 0; c < C; ++c) av[c] = _mm512_loadu_ps(acc.data() + j * HD + 16 * c);
          for (int i = 0; i < m; ++i) {
            const __m512 p = _mm512_set1_ps(pj[i]);
            for (int c = 0; c < C; ++c) av[c] = _mm512_fmadd_ps(p, _mm512_load_ps(buf + i * HD + 16 * c), av[c]);
          }
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc.data() + j * HD + 16 * c, av[c]);
        }
      }
      T* orow = out + (b * kvh + h) * g * HD;
      for (int64_t i = 0; i < g * HD; ++i) orow[i] = static_cast<T>(acc[i]);
    }
  });
}

#if defined(__AVX512BF16__)
// bf16 caches on a CPU with AVX512-BF16: q.k and p.v as vdpbf16ps (bf16 pairs multiplied, float32 sums), so the
// keys and values are never widened to float32. The probabilities are rounded to bf16 for p.v, as transformers'
// eager attention does (softmax in float32, then cast to the value dtype). For p.v the pairs run along positions:
// values t and t+1 are interleaved (unpacklo/hi_epi16), which puts head dims 8b..8b+3 of 128-bit block b in the
// "lo" accumulator and 8b+4..8b+7 in the "hi" one.
template <int HD>
static void run_bf16_dot(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc, const int64_t* pos,
                         const int64_t* rows, at::BFloat16* out, int64_t n, int64_t kvh, int64_t g, int64_t max_len,
                         int64_t cache_rows_stride, float scale, const int* lane_of) {
  constexpr int C = HD / 32;  // 32 bf16 per register
  at::parallel_for(0, n * kvh, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float blk[16];
    alignas(64) __m512i pairs[8 * 2 * C];  // 16 positions -> 8 interleaved pairs x C chunks x (lo, hi)
    alignas(64) float lo_hi[2 * 16 * C];
    std::vector<float> s;
    std::vector<uint16_t> pb;
    std::vector<__m512> acc;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / kvh, h = bh % kvh;
      const int64_t len = pos[b] + 1;
      const uint16_t* qrow = reinterpret_cast<const uint16_t*>(q) + (b * kvh + h) * g * HD;
      const uint16_t* kb = reinterpret_cast<const uint16_t*>(kc) + rows[b] * cache_rows_stride + h * max_len * HD;
      const uint16_t* vb = reinterpret_cast<const uint16_t*>(vc) + rows[b] * cache_rows_stride + h * max_len * HD;
      s.resize(g * len);
      const int64_t padded = (len + 1) / 2 * 2;
      pb.assign(g * padded, 0);
      for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, len - t0));
        for (int64_t j = 0; j < g; ++j) {
          __m512bh qv[C];
          for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qrow + j * HD + 32 * c);
          __m512 a[16];
          for (int i = 0; i < 16; ++i) {
            a[i] = _mm512_setzero_ps();
            if (i < m)
              for (int c = 0; c < C; ++c)
                a[i] = _mm512_dpbf16_ps(a[i], qv[c], (__m512bh)_mm512_loadu_si512(kb + (t0 + i) * HD + 32 * c));
          }
          _mm512_store_ps(blk, _mm512_mul_ps(sum16(a), _mm512_set1_ps(scale)));
          float* sj = s.data() + j * len + t0;
          for (int i = 0; i < m; ++i) sj[i] = blk[lane_of[i]];
        }
      }
      for (int64_t j = 0; j < g; ++j) {  // softmax in float32, then rounded to bf16 (nearest even)
        float* sj = s.data() + j * len;
        const float inv = exp_shifted(sj, len);
        uint16_t* pj = pb.data() + j * padded;
        int64_t t = 0;
        for (; t + 16 <= len; t += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pj + t),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(sj + t), _mm512_set1_ps(inv))));
        for (; t < len; ++t) pj[t] = c10::BFloat16(sj[t] * inv).x;
      }
      acc.assign(g * 2 * C, _mm512_setzero_ps());
      for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int m = static_cast<int>(std::min<int64_t>(16, len - t0));
        const int npairs = (m + 1) / 2;
        for (int r = 0; r < npairs; ++r) {
          const int64_t t = t0 + 2 * r;
          for (int c = 0; c < C; ++c) {
            const __m512i v0 = _mm512_loadu_si512(vb + t * HD + 32 * c);
            const __m512i v1 = t + 1 < len ? _mm512_loadu_si512(vb + (t + 1) * HD + 32 * c) : _mm512_setzero_si512();
            pairs[(r * C + c) * 2] = _mm512_unpacklo_epi16(v0, v1);
            pairs[(r * C + c) * 2 + 1] = _mm512_unpackhi_epi16(v0, v1);
          }
        }
        for (int64_t j = 0; j < g; ++j) {
          const uint16_t* pj = pb.data() + j * padded + t0;
          __m512* aj = acc.data() + j * 2 * C;
          __m512 av[2 * C];
          for (int k = 0; k < 2 * C; ++k) av[k] = aj[k];
          for (int r = 0; r < npairs; ++r) {
            int32_t word;
            std::memcpy(&word, pj + 2 * r, sizeof(word));
            const __m512bh p = (__m512bh)_mm512_set1_epi32(word);
            for (int k = 0; k < 2 * C; ++k) av[k] = _mm512_dpbf16_ps(av[k], p, (__m512bh)pairs[r * 2 * C + k]);
          }
          for (int k = 0; k < 2 * C; ++k) aj[k] = av[k];
        }
      }
      uint16_t* orow = reinterpret_cast<uint16_t*>(out) + (b * kvh + h) * g * HD;
      for (int64_t j = 0; j < g; ++j) {
        for (int k = 0; k < 2 * C; ++k) _mm512_store_ps(lo_hi + 16 * k, acc[j * 2 * C + k]);
        for (int c = 0; c < C; ++c)
          for (int blk4 = 0; blk4 < 4; ++blk4)
            for (int e = 0; e < 4; ++e) {
              orow[j * HD + 32 * c + 8 * blk4 + e] = c10::BFloat16(lo_hi[16 * (2 * c) + 4 * blk4 + e]).x;
              orow[j * HD + 32 * c + 8 * blk4 + 4 + e] = c10::BFloat16(lo_hi[16 * (2 * c + 1) + 4 * blk4 + e]).x;
            }
      }
    }
  });
}
#endif

// which lane of sum16's result holds the sum of a[i]: found once by summing a[i] = i (exact in float32)
static const int* sum16_lanes() {
  static int lane_of[16];
  static bool done = [] {
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_set1_ps(static_cast<float>(i));
    alignas(64) float r[16];
    _mm512_store_ps(r, sum16(a));
    for (int l = 0; l < 16; ++l) lane_of[static_cast<int>(r[l]) / 16] = l;
    return true;
  }();
  (void)done;
  return lane_of;
}
#endif

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
        const float inv = exp_shifted(sj, len);
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
#if defined(__AVX512F__)
#define DSPARK_FAST(T, HD) run_avx512<T, HD>(q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(), \
    pos.data_ptr<int64_t>(), rows.data_ptr<int64_t>(), out.data_ptr<T>(), n, kvh, g, max_len, stride, scale, \
    sum16_lanes())
#else
#define DSPARK_FAST(T, HD) run<T, HD>(q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(), pos.data_ptr<int64_t>(), \
    rows.data_ptr<int64_t>(), out.data_ptr<T>(), n, kvh, g, hd, max_len, stride, scale)
#endif
#define DSPARK_RUN(T, HD) run<T, HD>(q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(), pos.data_ptr<int64_t>(), \
                                     rows.data_ptr<int64_t>(), out.data_ptr<T>(), n, kvh, g, hd, max_len, stride, scale)
  if (q.scalar_type() == at::kBFloat16) {
#if defined(__AVX512BF16__)
#define DSPARK_DOT(HD) run_bf16_dot<HD>(q.data_ptr<at::BFloat16>(), kc.data_ptr<at::BFloat16>(), \
    vc.data_ptr<at::BFloat16>(), pos.data_ptr<int64_t>(), rows.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), \
    n, kvh, g, max_len, stride, scale, sum16_lanes())
    if (hd == 64) DSPARK_DOT(64); else if (hd == 128) DSPARK_DOT(128); else DSPARK_RUN(at::BFloat16, 0);
#undef DSPARK_DOT
#else
    if (hd == 64) DSPARK_FAST(at::BFloat16, 64); else if (hd == 128) DSPARK_FAST(at::BFloat16, 128);
    else DSPARK_RUN(at::BFloat16, 0);
#endif
  } else {
    if (hd == 64) DSPARK_FAST(float, 64); else if (hd == 128) DSPARK_FAST(float, 128); else DSPARK_RUN(float, 0);
  }
#undef DSPARK_RUN
#undef DSPARK_FAST
  return out;
}
"""

def _load():
    """The compiled kernel module, or None (no compiler: the reference runs)."""
    return load_cpu_kernel("dspark_decode_attention_v7", _SOURCE, ["decode_attention"], "torch ops (slower)")


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
            and (kernel := _load()) is not None):
        with torch.profiler.record_function("dspark::decode_attention"):
            return kernel.decode_attention(q.contiguous(), k_cache.contiguous(), v_cache.contiguous(),
                                            pos.to(torch.int64).contiguous(), rows.to(torch.int64).contiguous(),
                                            float(scale))
    return decode_attention_reference(q, k_cache, v_cache, pos, rows, scale)

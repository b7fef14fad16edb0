"""C++ kernels for decode steps (few rows), compiled once on first use.

``small_gemm``: float32 matmul for few rows.

Why: a decode step multiplies 1–16 rows by every weight matrix. MKL's ``sgemm`` is tuned for
large matrices; for 2–16 rows it runs far below the core's FMA rate (measured on the 2-core AMD
EPYC of ``bench/RESULTS.md``: 2 rows cost twice one row, 4 rows 3–6× one row for the 113 MB LM
head). This kernel reads each weight once per step from a pre-packed layout and keeps up to 6
rows' accumulators in AVX2 registers; a 16-row decode step of SmolLM2 went from ~150 ms to
~80 ms on one thread.

Layout: a ``[K, N]`` weight (``x @ W`` form) is packed to ``[ceil(N/16), K, 16]``: each block of
16 output columns is one contiguous stream. Every output element is one sequential FMA chain
over ``k = 0..K-1`` whatever the number of rows, so in steps of at most :data:`SMALL_ROWS` rows
a row's result does not depend on what else shares its batch (a step with a prefill chunk runs
on MKL, whose results are not bit-identical to these).

Two paths, chosen at run time: AVX2 (tiles of up to 6 rows x 16 columns in pairs of 8-wide
registers) and, where the CPU has it, AVX-512 (one 16-column block per register; tiles of up
to 8 rows x 3 blocks, 24 accumulators). Both compute every element as the same FMA chain, so
their results are bit-identical (tests/engine/test_kernels_gemm.py). On the 2-core Xeon
(AVX-512) of ``bench/RESULTS.md`` the AVX-512 path takes 16-row products in 0.55–0.7x the CPU
time of the AVX2 one (LM head 26 -> 18 ms, MLP up-projection 1.1 -> 0.6 ms, one thread); a
16-row decode step of SmolLM2 went from 180 to 118 ms of CPU time. One row is memory-bound
either way.

The C++ source is built with ``torch.utils.cpp_extension.load_inline`` (needs a C++ compiler
and ninja; the build is cached under ``~/.cache/torch_extensions``, one build per torch
installation: see :func:`extension_name`). Without AVX2/FMA, without a compiler, or with
``SIEPROXY_ENGINE_KERNELS=0``, :func:`load_kernels` returns ``None`` and the model uses torch
ops everywhere.

``decode_attention``: one query token per sequence against its own cached length, straight from
the KV pool — no padding to the longest sequence, no mask, no per-layer batched-matmul
dispatch (torch's ``bmm``/``softmax``/``bmm`` on ``[16 slots x 3 heads]`` of 3x64 queries cost
more than all the attention arithmetic). Softmax uses an AVX2 polynomial ``exp`` (about 1 ulp).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

__all__ = ["SMALL_ROWS", "Kernels", "load_kernels", "pack_weight"]

log = logging.getLogger("engine.cpu.kernels")

# Up to this many rows the kernel matched or beat MKL on every SmolLM2 weight shape measured
# (1 and 2 threads); above it (prefill chunks) MKL's blocked sgemm is as fast or faster.
SMALL_ROWS = 32

_BLOCK = 16

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// One tile: R rows (R <= 6) x NB blocks of 16 columns; accumulators stay in registers.
// Every output element is acc = fma(x[k], w[k], acc) for k = 0..K-1, in that order.
#define SG_DECL(i, b) __m256 a##i##b##0 = _mm256_setzero_ps(), a##i##b##1 = _mm256_setzero_ps();
#define SG_FMA(i, b) { const __m256 xv = _mm256_broadcast_ss(x + (i) * ldx + k); \
  a##i##b##0 = _mm256_fmadd_ps(xv, w##b##0, a##i##b##0); \
  a##i##b##1 = _mm256_fmadd_ps(xv, w##b##1, a##i##b##1); }
#define SG_LOAD(b) const __m256 w##b##0 = _mm256_loadu_ps(w + (b) * bs + k * 16); \
  const __m256 w##b##1 = _mm256_loadu_ps(w + (b) * bs + k * 16 + 8);
#define SG_STORE(i, b) _mm256_storeu_ps(out + (i) * ldo + (b) * 16, a##i##b##0); \
  _mm256_storeu_ps(out + (i) * ldo + (b) * 16 + 8, a##i##b##1);

static inline void tile_r6(const float* x, int64_t ldx, const float* w, int64_t K, int64_t bs,
                           float* out, int64_t ldo) {
  SG_DECL(0, 0) SG_DECL(1, 0) SG_DECL(2, 0) SG_DECL(3, 0) SG_DECL(4, 0) SG_DECL(5, 0)
  for (int64_t k = 0; k < K; ++k) {
    SG_LOAD(0)
    SG_FMA(0, 0) SG_FMA(1, 0) SG_FMA(2, 0) SG_FMA(3, 0) SG_FMA(4, 0) SG_FMA(5, 0)
  }
  SG_STORE(0, 0) SG_STORE(1, 0) SG_STORE(2, 0) SG_STORE(3, 0) SG_STORE(4, 0) SG_STORE(5, 0)
}

static inline void tile_r4(const float* x, int64_t ldx, const float* w, int64_t K, int64_t bs,
                           float* out, int64_t ldo) {
  SG_DECL(0, 0) SG_DECL(1, 0) SG_DECL(2, 0) SG_DECL(3, 0)
  for (int64_t k = 0; k < K; ++k) {
    SG_LOAD(0)
    SG_FMA(0, 0) SG_FMA(1, 0) SG_FMA(2, 0) SG_FMA(3, 0)
  }
  SG_STORE(0, 0) SG_STORE(1, 0) SG_STORE(2, 0) SG_STORE(3, 0)
}

static inline void tile_r3(const float* x, int64_t ldx, const float* w, int64_t K, int64_t bs,
                           float* out, int64_t ldo) {
  SG_DECL(0, 0) SG_DECL(1, 0) SG_DECL(2, 0)
  for (int64_t k = 0; k < K; ++k) {
    SG_LOAD(0)
    SG_FMA(0, 0) SG_FMA(1, 0) SG_FMA(2, 0)
  }
  SG_STORE(0, 0) SG_STORE(1, 0) SG_STORE(2, 0)
}

// Two rows x two blocks, one row x four blocks: enough independent FMA chains to hide latency.
static inline void tile_r2b2(const float* x, int64_t ldx, const float* w, int64_t K,
                             int64_t bs, float* out, int64_t ldo) {
  SG_DECL(0, 0) SG_DECL(1, 0) SG_DECL(0, 1) SG_DECL(1, 1)
  for (int64_t k = 0; k < K; ++k) {
    SG_LOAD(0) SG_LOAD(1)
    SG_FMA(0, 0) SG_FMA(1, 0) SG_FMA(0, 1) SG_FMA(1, 1)
  }
  SG_STORE(0, 0) SG_STORE(1, 0) SG_STORE(0, 1) SG_STORE(1, 1)
}

static inline void tile_r2(const float* x, int64_t ldx, const float* w, int64_t K, int64_t bs,
                           float* out, int64_t ldo) {
  SG_DECL(0, 0) SG_DECL(1, 0)
  for (int64_t k = 0; k < K; ++k) {
    SG_LOAD(0)
    SG_FMA(0, 0) SG_FMA(1, 0)
  }
  SG_STORE(0, 0) SG_STORE(1, 0)
}

static inline void tile_r1b4(const float* x, int64_t ldx, const float* w, int64_t K,
                             int64_t bs, float* out, int64_t ldo) {
  SG_DECL(0, 0) SG_DECL(0, 1) SG_DECL(0, 2) SG_DECL(0, 3)
  for (int64_t k = 0; k < K; ++k) {
    SG_LOAD(0) SG_LOAD(1) SG_LOAD(2) SG_LOAD(3)
    SG_FMA(0, 0) SG_FMA(0, 1) SG_FMA(0, 2) SG_FMA(0, 3)
  }
  SG_STORE(0, 0) SG_STORE(0, 1) SG_STORE(0, 2) SG_STORE(0, 3)
}

static inline void tile_r1(const float* x, int64_t ldx, const float* w, int64_t K, int64_t bs,
                           float* out, int64_t ldo) {
  SG_DECL(0, 0)
  for (int64_t k = 0; k < K; ++k) {
    SG_LOAD(0)
    SG_FMA(0, 0)
  }
  SG_STORE(0, 0)
}

// The work loop of both paths: units of `group` column blocks, split between the threads;
// within a unit, row tiles pass over the unit's weights (which stay in L1/L2 meanwhile).
// tile(xr, orow, rows_left, b0, b1) computes a tile of rows from xr/orow, returns its rows.
template <class Tile>
static void gemm_units(const float* xp, int64_t ldx, float* op, int64_t ldo, int64_t M,
                       int64_t nblk, int64_t group, const Tile& tile) {
  const int64_t ngroups = (nblk + group - 1) / group;
  at::parallel_for(0, ngroups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * group, b1 = std::min(b0 + group, nblk);
      for (int64_t m = 0; m < M;) m += tile(xp + m * ldx, op + m * ldo, M - m, b0, b1);
    }
  });
}

// AVX-512: one block of 16 columns is one register. A tile of R rows x B blocks keeps R * B
// accumulators (at most 24 of the 32 registers); each output element is the same FMA chain
// over k = 0..K-1 as in the AVX2 tiles above, so both give bit-identical results.
#define SG512 __attribute__((target("avx512f")))

template <int R, int B>
SG512 static inline void tile512(const float* x, int64_t ldx, const float* w, int64_t K,
                                 int64_t bs, float* out, int64_t ldo) {
  __m512 acc[R][B];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) acc[i][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_ps(w + b * bs + k * 16);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * ldx + k]);
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) acc[i][b] = _mm512_fmadd_ps(xv, wv[b], acc[i][b]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(out + i * ldo + b * 16, acc[i][b]);
}

// Rows [m, m + R) x blocks [b0, b1) in tiles of three blocks, then single blocks.
template <int R>
SG512 static void rows512(const float* xr, int64_t ldx, const float* wp, int64_t K, int64_t bs,
                          float* orow, int64_t ldo, int64_t b0, int64_t b1) {
  int64_t b = b0;
  for (; b + 3 <= b1; b += 3) tile512<R, 3>(xr, ldx, wp + b * bs, K, bs, orow + b * 16, ldo);
  for (; b < b1; ++b) tile512<R, 1>(xr, ldx, wp + b * bs, K, bs, orow + b * 16, ldo);
}

// Rows [0, r) of xr x blocks [b0, b1), r in 1..8 (a non-inlined AVX-512 function).
SG512 static void tile_rows512(int64_t r, const float* xr, int64_t ldx, const float* wp,
                               int64_t K, int64_t bs, float* orow, int64_t ldo, int64_t b0,
                               int64_t b1) {
  switch (r) {
    case 8: rows512<8>(xr, ldx, wp, K, bs, orow, ldo, b0, b1); break;
    case 7: rows512<7>(xr, ldx, wp, K, bs, orow, ldo, b0, b1); break;
    case 6: rows512<6>(xr, ldx, wp, K, bs, orow, ldo, b0, b1); break;
    case 5: rows512<5>(xr, ldx, wp, K, bs, orow, ldo, b0, b1); break;
    case 4: rows512<4>(xr, ldx, wp, K, bs, orow, ldo, b0, b1); break;
    case 3: rows512<3>(xr, ldx, wp, K, bs, orow, ldo, b0, b1); break;
    case 2: rows512<2>(xr, ldx, wp, K, bs, orow, ldo, b0, b1); break;
    default: rows512<1>(xr, ldx, wp, K, bs, orow, ldo, b0, b1); break;
  }
}

// Which small_gemm path runs: 1 = AVX-512 where the CPU has it, 0 = AVX2 only.
static int g_gemm_isa = __builtin_cpu_supports("avx512f") ? 1 : 0;

// Set the small_gemm path (0: AVX2; 1: AVX-512 if the CPU has it); return the one in effect.
int64_t gemm_isa(int64_t isa) {
  if (isa >= 0) g_gemm_isa = (isa >= 1 && __builtin_cpu_supports("avx512f")) ? 1 : 0;
  return g_gemm_isa;
}

// x: [M, K] float32 with unit column stride; packed: [NB, K, 16]. Returns [M, NB * 16].
torch::Tensor small_gemm(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1,
              "x must be a float32 matrix with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kFloat &&
              packed.is_contiguous() && packed.size(2) == 16 && packed.size(1) == x.size(1),
              "packed must be a contiguous float32 [blocks, K, 16] tensor");
  const int64_t M = x.size(0), K = x.size(1), nblk = packed.size(0);
  auto out = torch::empty({M, nblk * 16}, x.options());
  if (M == 0 || nblk == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = nblk * 16, bs = K * 16;
  if (g_gemm_isa == 1) {
    // Units of 6 column blocks (two tiles of three; at most 6 x K x 64 bytes of weights);
    // eight rows at a time, a remainder of 9-15 split into two tiles of similar size.
    gemm_units(xp, ldx, op, ldo, M, nblk, 6,
               [&](const float* xr, float* orow, int64_t rem, int64_t b0, int64_t b1) {
                 const int64_t r = rem >= 16 || rem == 8 ? 8 : rem > 8 ? (rem + 1) / 2 : rem;
                 tile_rows512(r, xr, ldx, wp, K, bs, orow, ldo, b0, b1);
                 return r;
               });
    return out;
  }
  // Units of 4 column blocks.
  gemm_units(xp, ldx, op, ldo, M, nblk, 4,
             [&](const float* xr, float* orow, int64_t rem, int64_t b0, int64_t b1) -> int64_t {
    int64_t b = b0;
    if (rem >= 6 && rem != 8) {
      for (; b < b1; ++b) tile_r6(xr, ldx, wp + b * bs, K, bs, orow + b * 16, ldo);
      return 6;
    } else if (rem >= 4) {
      for (; b < b1; ++b) tile_r4(xr, ldx, wp + b * bs, K, bs, orow + b * 16, ldo);
      return 4;
    } else if (rem == 3) {
      for (; b < b1; ++b) tile_r3(xr, ldx, wp + b * bs, K, bs, orow + b * 16, ldo);
      return 3;
    } else if (rem == 2) {
      for (; b + 2 <= b1; b += 2) tile_r2b2(xr, ldx, wp + b * bs, K, bs, orow + b * 16, ldo);
      for (; b < b1; ++b) tile_r2(xr, ldx, wp + b * bs, K, bs, orow + b * 16, ldo);
      return 2;
    }
    for (; b + 4 <= b1; b += 4) tile_r1b4(xr, ldx, wp + b * bs, K, bs, orow + b * 16, ldo);
    for (; b < b1; ++b) tile_r1(xr, ldx, wp + b * bs, K, bs, orow + b * 16, ldo);
    return 1;
  });
  return out;
}

// exp for AVX2 (Cephes-style range reduction + degree-6 polynomial; ~1 ulp on [-88, 88]).
static inline __m256 exp256(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  const __m256 x2 = _mm256_mul_ps(x, x);
  y = _mm256_fmadd_ps(y, x2, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_cvttps_epi32(fx);
  e = _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Decode attention: one query token per row. q: [n, heads, D]; kc, vc: [slots, kv_heads, cap, D]
// (contiguous); slots, lengths: int64 [n]. Row r attends to positions [0, lengths[r]) of its
// slot. Returns [n, heads, D]. Work unit: one (row, kv head) with its `heads / kv_heads` queries.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor kc, torch::Tensor vc,
                               torch::Tensor slots, torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == torch::kFloat);
  TORCH_CHECK(kc.dim() == 4 && kc.is_contiguous() && vc.is_contiguous() &&
              kc.sizes() == vc.sizes() && kc.scalar_type() == torch::kFloat &&
              vc.scalar_type() == torch::kFloat);
  const int64_t n = q.size(0), heads = q.size(1), D = q.size(2);
  const int64_t kvh = kc.size(1), cap = kc.size(2);
  TORCH_CHECK(kc.size(3) == D && D % 64 == 0 && heads % kvh == 0);
  auto slots_c = slots.to(torch::kLong).contiguous();
  auto lengths_c = lengths.to(torch::kLong).contiguous();
  const int64_t* sp = slots_c.data_ptr<int64_t>();
  const int64_t* lp = lengths_c.data_ptr<int64_t>();
  int64_t max_len = 1;
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < kc.size(0) && lp[r] >= 1 && lp[r] <= cap);
    max_len = std::max(max_len, lp[r]);
  }
  const int64_t group = heads / kvh, nv = D / 8;
  auto out = torch::empty({n, heads, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, n * kvh, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(static_cast<size_t>(max_len + 8));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / kvh, h = t % kvh, len = lp[r];
      const float* kb = kp + ((sp[r] * kvh + h) * cap) * D;
      const float* vb = vp + ((sp[r] * kvh + h) * cap) * D;
      for (int64_t g = 0; g < group; ++g) {
        const float* qv = qp + (r * heads + h * group + g) * D;
        // Scores, four keys at a time (four independent FMA chains).
        int64_t l = 0;
        for (; l + 4 <= len; l += 4) {
          const float* k0 = kb + l * D;
          __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
          __m256 c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
          for (int64_t j = 0; j < nv; ++j) {
            const __m256 qj = _mm256_loadu_ps(qv + 8 * j);
            c0 = _mm256_fmadd_ps(qj, _mm256_loadu_ps(k0 + 8 * j), c0);
            c1 = _mm256_fmadd_ps(qj, _mm256_loadu_ps(k0 + D + 8 * j), c1);
            c2 = _mm256_fmadd_ps(qj, _mm256_loadu_ps(k0 + 2 * D + 8 * j), c2);
            c3 = _mm256_fmadd_ps(qj, _mm256_loadu_ps(k0 + 3 * D + 8 * j), c3);
          }
          scores[l] = hsum256(c0) * sc;
          scores[l + 1] = hsum256(c1) * sc;
          scores[l + 2] = hsum256(c2) * sc;
          scores[l + 3] = hsum256(c3) * sc;
        }
        for (; l < len; ++l) {
          const float* kr = kb + l * D;
          __m256 c0 = _mm256_setzero_ps();
          for (int64_t j = 0; j < nv; ++j)
            c0 = _mm256_fmadd_ps(_mm256_loadu_ps(qv + 8 * j), _mm256_loadu_ps(kr + 8 * j), c0);
          scores[l] = hsum256(c0) * sc;
        }
        float mx = -INFINITY;
        for (l = 0; l < len; ++l) mx = std::max(mx, scores[l]);
        // exp(score - max); the padding lanes of the last vector are exp(-100) and never used.
        for (l = len; l < len + 8; ++l) scores[l] = mx - 100.0f;
        const __m256 mxv = _mm256_set1_ps(mx);
        for (l = 0; l < len; l += 8)
          _mm256_storeu_ps(&scores[l], exp256(_mm256_sub_ps(_mm256_loadu_ps(&scores[l]), mxv)));
        float sum = 0.0f;
        for (l = 0; l < len; ++l) sum += scores[l];
        const __m256 inv = _mm256_set1_ps(1.0f / sum);
        // Weighted sum of values, 64 dims (eight registers) at a time.
        float* o = op + (r * heads + h * group + g) * D;
        for (int64_t j0 = 0; j0 < nv; j0 += 8) {
          __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
          __m256 a3 = _mm256_setzero_ps(), a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps();
          __m256 a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
          for (int64_t m = 0; m < len; ++m) {
            const __m256 pm = _mm256_set1_ps(scores[m]);
            const float* vr = vb + m * D + 8 * j0;
            a0 = _mm256_fmadd_ps(pm, _mm256_loadu_ps(vr), a0);
            a1 = _mm256_fmadd_ps(pm, _mm256_loadu_ps(vr + 8), a1);
            a2 = _mm256_fmadd_ps(pm, _mm256_loadu_ps(vr + 16), a2);
            a3 = _mm256_fmadd_ps(pm, _mm256_loadu_ps(vr + 24), a3);
            a4 = _mm256_fmadd_ps(pm, _mm256_loadu_ps(vr + 32), a4);
            a5 = _mm256_fmadd_ps(pm, _mm256_loadu_ps(vr + 40), a5);
            a6 = _mm256_fmadd_ps(pm, _mm256_loadu_ps(vr + 48), a6);
            a7 = _mm256_fmadd_ps(pm, _mm256_loadu_ps(vr + 56), a7);
          }
          float* oj = o + 8 * j0;
          _mm256_storeu_ps(oj, _mm256_mul_ps(a0, inv));
          _mm256_storeu_ps(oj + 8, _mm256_mul_ps(a1, inv));
          _mm256_storeu_ps(oj + 16, _mm256_mul_ps(a2, inv));
          _mm256_storeu_ps(oj + 24, _mm256_mul_ps(a3, inv));
          _mm256_storeu_ps(oj + 32, _mm256_mul_ps(a4, inv));
          _mm256_storeu_ps(oj + 40, _mm256_mul_ps(a5, inv));
          _mm256_storeu_ps(oj + 48, _mm256_mul_ps(a6, inv));
          _mm256_storeu_ps(oj + 56, _mm256_mul_ps(a7, inv));
        }
      }
    }
  });
  return out;
}

// RMS norm over the last dim of x [M, H] (rows contiguous): w * (x * rsqrt(mean(x^2) + eps)).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat);
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == torch::kFloat);
  const int64_t M = x.size(0), H = x.size(1), ldx = x.stride(0);
  auto out = torch::empty({M, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t hv = H - H % 8;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * ldx;
    float* orow = op + m * H;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < hv; j += 8) {
      const __m256 v = _mm256_loadu_ps(xr + j);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum256(acc);
    for (int64_t j = hv; j < H; ++j) ss += xr[j] * xr[j];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
    const __m256 rv = _mm256_set1_ps(r);
    for (int64_t j = 0; j < hv; j += 8)
      _mm256_storeu_ps(orow + j, _mm256_mul_ps(_mm256_loadu_ps(wp + j),
                                               _mm256_mul_ps(_mm256_loadu_ps(xr + j), rv)));
    for (int64_t j = hv; j < H; ++j) orow[j] = wp[j] * (xr[j] * r);
  }
  return out;
}

// SwiGLU activation: gu [M, 2 * I] (rows contiguous) -> silu(gu[:, :I]) * gu[:, I:].
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 16 == 0 &&
              gu.scalar_type() == torch::kFloat);
  const int64_t M = gu.size(0), I = gu.size(1) / 2, ld = gu.stride(0);
  auto out = torch::empty({M, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gp + m * ld;
    float* o = op + m * I;
    for (int64_t j = 0; j < I; j += 8) {
      const __m256 a = _mm256_loadu_ps(g + j);
      const __m256 s = _mm256_div_ps(a, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, a))));
      _mm256_storeu_ps(o + j, _mm256_mul_ps(s, _mm256_loadu_ps(g + I + j)));
    }
  }
  return out;
}

// Write one token per row into the KV pool: kc[slots[r], h, positions[r]] = k[rows[r], h] (and v).
// k, v: [n, kv_heads, D] with unit stride on D and D-strided heads (any row stride).
void store_kv(torch::Tensor kc, torch::Tensor vc, torch::Tensor k, torch::Tensor v,
              torch::Tensor rows, torch::Tensor slots, torch::Tensor positions) {
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes());
  const int64_t kvh = kc.size(1), cap = kc.size(2), D = kc.size(3);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(1) == kvh && k.size(2) == D &&
              v.size(1) == kvh && v.size(2) == D);
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D);
  auto rows_c = rows.to(torch::kLong).contiguous();
  auto slots_c = slots.to(torch::kLong).contiguous();
  auto pos_c = positions.to(torch::kLong).contiguous();
  const int64_t n = rows_c.numel();
  const int64_t* rp = rows_c.data_ptr<int64_t>();
  const int64_t* sp = slots_c.data_ptr<int64_t>();
  const int64_t* pp = pos_c.data_ptr<int64_t>();
  float* kd = kc.data_ptr<float>();
  float* vd = vc.data_ptr<float>();
  const float* ks = k.data_ptr<float>();
  const float* vs = v.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < k.size(0) && sp[i] >= 0 && sp[i] < kc.size(0) &&
                pp[i] >= 0 && pp[i] < cap);
    for (int64_t h = 0; h < kvh; ++h) {
      const int64_t dst = ((sp[i] * kvh + h) * cap + pp[i]) * D;
      std::memcpy(kd + dst, ks + rp[i] * k.stride(0) + h * D, D * sizeof(float));
      std::memcpy(vd + dst, vs + rp[i] * v.stride(0) + h * D, D * sizeof(float));
    }
  }
}
"""


@dataclass(frozen=True)
class Kernels:
    """The compiled functions.

    ``small_gemm(x [M, K], packed [blocks, K, 16]) -> [M, blocks * 16]``;
    ``decode_attention(q [n, heads, D], k_cache, v_cache, slots [n], lengths [n], scale)
    -> [n, heads, D]`` — one query token per row over the first ``lengths[r]`` cached
    positions of slot ``slots[r]`` (caches ``[slots, kv_heads, capacity, D]``, contiguous,
    ``D`` a multiple of 64); ``rms_norm(x, weight, eps)`` and ``silu_mul(gate_up)`` (SwiGLU)
    for few rows, where torch's generic ops cost 20–100 µs each in dispatch alone;
    ``store_kv(k_cache, v_cache, k, v, rows, slots, positions)`` writes one token per row
    into the pool (torch's ``index_put_`` costs ~80 µs per call for 16 rows);
    ``gemm_isa(isa)`` selects ``small_gemm``'s path — 1: AVX-512 where the CPU has it (the
    default there), 0: AVX2 — and returns the one in effect (-1: only ask). Both paths give
    bit-identical results.
    """

    small_gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    decode_attention: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
        torch.Tensor,
    ]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    store_kv: Callable[
        [
            torch.Tensor,
            torch.Tensor,
            torch.Tensor,
            torch.Tensor,
            torch.Tensor,
            torch.Tensor,
            torch.Tensor,
        ],
        None,
    ]
    gemm_isa: Callable[[int], int]


_lock = threading.Lock()
_loaded = False
_kernels: Kernels | None = None


def extension_name(torch_dir: str | None = None) -> str:
    """The extension's name, and so its build directory, for the torch installed at
    ``torch_dir`` (this process's by default). torch keys a cached build by its name, and a
    build's command lines hold the installation's include paths: two virtual environments
    (tox's test and serve) sharing one name would each rebuild it (about a minute) every time
    the other had built it last. The source is part of the key too: trees with different
    kernels (two checkouts, a branch and its base) sharing one torch each keep their build."""
    where = os.path.realpath(torch_dir or os.path.dirname(torch.__file__))
    key = hashlib.sha256(where.encode() + b"\0" + _SOURCE.encode()).hexdigest()[:12]
    return "sieproxy_cpu_kernels_" + key


def load_kernels() -> Kernels | None:
    """The compiled kernels, or None if unavailable (see the module docstring).

    Built on the first call (about a minute the first time on a machine, then cached).
    """
    global _loaded, _kernels
    with _lock:
        if _loaded:
            return _kernels
        _loaded = True
        if os.environ.get("SIEPROXY_ENGINE_KERNELS", "1").strip().lower() in {"0", "false", "no"}:
            log.info("CPU engine kernels disabled by SIEPROXY_ENGINE_KERNELS")
            return None
        # Only x86-64 reports these (AVX512 machines have AVX2 and FMA too).
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in {"AVX2", "AVX512"}:
            log.info("CPU engine kernels need x86-64 AVX2 (have %s)", capability)
            return None
        names = [field.name for field in fields(Kernels)]
        started = time.monotonic()
        cold = not _built(extension_name())
        if cold:  # about a minute of silence otherwise
            _say("building the decode kernels (about a minute, once per PyTorch installation)")
        try:
            from torch.utils.cpp_extension import load_inline

            module = load_inline(  # type: ignore[no-untyped-call]
                name=extension_name(),
                cpp_sources=_SOURCE,
                functions=names,
                extra_cflags=["-O3", "-mavx2", "-mfma"],
                verbose=False,
            )
        except Exception as exc:  # no compiler, no ninja, headers missing, ...
            log.warning("CPU engine kernels unavailable, using torch ops: %s", exc)
            return None
        _kernels = Kernels(**{name: getattr(module, name) for name in names})
        if cold:
            _say(f"decode kernels built in {time.monotonic() - started:.0f} s")
        return _kernels


def _built(name: str) -> bool:
    """Whether ``name``'s compiled module is already in torch's extension cache."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        where = _get_build_directory(name, verbose=False)
    except Exception:
        return False
    return any(f.startswith(name) and f.endswith((".so", ".pyd")) for f in os.listdir(where))


def _say(message: str) -> None:
    print(f"[sieproxy-engine] {message}", file=sys.stderr, flush=True)


def pack_weight(weight_t: torch.Tensor) -> torch.Tensor:
    """Pack a ``[K, N]`` float32 weight (used as ``x @ weight_t``) to ``[ceil(N/16), K, 16]``.

    Columns beyond ``N`` (padding to a multiple of 16) are zero; callers slice them off.
    """
    k, n = weight_t.shape
    blocks = -(-n // _BLOCK)
    padded = F.pad(weight_t.float(), (0, blocks * _BLOCK - n))
    return padded.reshape(k, blocks, _BLOCK).permute(1, 0, 2).contiguous()

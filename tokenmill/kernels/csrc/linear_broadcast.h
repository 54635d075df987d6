// Linear layers for 16 rows and more as outer-product tiles: on AVX2 without AVX-512 (float32 and
// bfloat16 weights; first below) and on AVX-512 for float32 weights (`tm_broadcast512`, last below).
// AVX2: y [M, N] = x [M, K] @ w[N, K]^T (+ bias)
// as outer products, which need no horizontal sums and fewer loads per FMA than linear.cpp's dot-product
// tiles. x (float32; bfloat16 x comes widened) is packed once per call into panels of 16 rows, k-major
// ([K][16] each, zeros past M). A tile holds 6 weight rows x 16 x rows in 12 vector accumulators: for
// each k, one weight of each row is broadcast against the panel's two vectors, 12 FMAs per 2 vector
// loads and 6 broadcasts. bfloat16 weights are first widened to float32, a tile's 6 rows at a time,
// once for all the panels (broadcast from their own 16 bits, each took a load, a shuffle and a
// shift, for every panel: slower, the more so the more rows; results/linear_variants_avx2_bf16_widen.json). A last
// panel of at most 8 real rows runs the one-vector tile (6 accumulators). The weights stay in their
// checkpoint layout: each of a tile's rows is a sequential stream of scalars. The accumulators are
// named variables, not an array (GCC kept an array of them on the stack, stored on every step), and
// the k loop is not unrolled (unrolled, GCC's register allocation chained FMAs through temporaries).
// On AVX2, the peer model's weights at 16-256 rows, float32 and bfloat16: faster than the dot-product
// tiles and, at 256 rows, than torch's GEMM (benchmarks/linear_variants.py,
// results/linear_variants_avx2.json).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "convert.h"

namespace tm_panels {

// x [M, K] (row stride x_row) -> panels [ceil(M / MP)][K][MP], zero past M: the k-major input panels
// both tile families below read (MP rows a panel: 16 on AVX2, 32 on AVX-512).
template <int64_t MP>
inline void pack_x(const float* x, int64_t x_row, int64_t M, int64_t K, float* panels) {
  const int64_t count = (M + MP - 1) / MP;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      float* dst = panels + p * K * MP;
      const int64_t rows = std::min<int64_t>(MP, M - p * MP);
      for (int64_t i = 0; i < rows; ++i) {
        const float* src = x + (p * MP + i) * x_row;
        for (int64_t k = 0; k < K; ++k) dst[k * MP + i] = src[k];
      }
      for (int64_t i = rows; i < MP; ++i)
        for (int64_t k = 0; k < K; ++k) dst[k * MP + i] = 0.f;
    }
  });
}

// x [M, K] (row stride x_row) as float32 rows: float32 x itself, bfloat16 x widened into `buffer`
// (resized to [M, K]; x_row becomes K).
template <typename T>
inline const float* float_rows(const T* x, int64_t& x_row, int64_t M, int64_t K, std::vector<float>& buffer) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    buffer.resize(M * K);
    const int64_t stride = x_row;
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) to_float(x + m * stride, buffer.data() + m * K, K);
    });
    x_row = K;
    return buffer.data();
  }
}

}  // namespace tm_panels

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(TM_NO_BROADCAST)
#define TM_BROADCAST_TILES 1

namespace tm_broadcast {

constexpr int NR = 6;   // weight rows per tile
constexpr int MP = 16;  // x rows per panel: two vectors of 8


// out[r][i] (+ bias) for the tile's rows r < NR and panel rows i < rows.
template <typename T>
inline void store(const __m256* acc, int nv, int64_t rows, T* y, int64_t y_row, const T* bias) {
  for (int r = 0; r < NR; ++r) {
    alignas(32) float sums[MP];
    _mm256_store_ps(sums, acc[r * 2]);
    if (nv == 2) _mm256_store_ps(sums + 8, acc[r * 2 + 1]);
    const float b = bias ? static_cast<float>(bias[r]) : 0.f;
    for (int64_t i = 0; i < rows; ++i) y[i * y_row + r] = from_float<T>(sums[i] + b);
  }
}

// One weight broadcast to 8 float32 lanes (bfloat16: 16 bits into every half-lane, shifted into place).
inline __m256 bcast(const float* w) { return _mm256_broadcast_ss(w); }
inline __m256 bcast(const c10::BFloat16* w) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi16(static_cast<short>(w->x)), 16));
}

#define TM_ROW2(r, b)                               \
  c##r##0 = _mm256_fmadd_ps(b, x0, c##r##0);        \
  c##r##1 = _mm256_fmadd_ps(b, x1, c##r##1);
#define TM_ROW1(r, b) c##r##0 = _mm256_fmadd_ps(b, x0, c##r##0);
// every row of the tile at k (x0, x1: the panel's vectors at k)
#define TM_ROWS(ROW, k)                                                              \
  {                                                                                  \
    __m256 b = bcast(w0 + (k));                                                      \
    ROW(0, b) b = bcast(w1 + (k));                                                   \
    ROW(1, b) b = bcast(w2 + (k));                                                   \
    ROW(2, b) b = bcast(w3 + (k));                                                   \
    ROW(3, b) b = bcast(w4 + (k));                                                   \
    ROW(4, b) b = bcast(w5 + (k));                                                   \
    ROW(5, b)                                                                        \
  }

// y[i, r] for the 6 weight rows from w (row stride K) and a panel (rows of its 16 real); NV = 2: both
// vectors, NV = 1: the first only (at most 8 real rows). W: the weights' type as read here (float32
// rows widened beforehand, or the checkpoint's own); T: the output's. STREAM: w is the weights
// themselves (the next tile's rows prefetched here), not rows widened into a scratch buffer.
template <int NV, bool STREAM, typename W, typename T>
inline void tile(const W* w, int64_t K, const float* panel, int64_t rows, T* y, int64_t y_row, const T* bias) {
  const W *w0 = w, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K, *w4 = w3 + K, *w5 = w4 + K;
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  constexpr int64_t line = 64 / sizeof(W);  // weights per cache line
  int64_t k = 0;
  for (; k + line <= K; k += line) {
    // the next tile's rows, one line ahead of their first use (a prefetch past the end is a hint);
    // rows widened beforehand were prefetched as they were widened
    if constexpr (STREAM)
      for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (r + NR) * K + k), _MM_HINT_T0);
#pragma GCC unroll 1  // see the top
    for (int64_t u = 0; u < line; ++u) {
      const float* px = panel + (k + u) * MP;
      const __m256 x0 = _mm256_loadu_ps(px);
      if constexpr (NV == 2) {
        const __m256 x1 = _mm256_loadu_ps(px + 8);
        TM_ROWS(TM_ROW2, k + u)
      } else {
        TM_ROWS(TM_ROW1, k + u)
      }
    }
  }
  for (; k < K; ++k) {
    const float* px = panel + k * MP;
    const __m256 x0 = _mm256_loadu_ps(px);
    if constexpr (NV == 2) {
      const __m256 x1 = _mm256_loadu_ps(px + 8);
      TM_ROWS(TM_ROW2, k)
    } else {
      TM_ROWS(TM_ROW1, k)
    }
  }
  const __m256 acc[2 * NR] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  store(acc, NV, rows, y, y_row, bias);
}
#undef TM_ROWS
#undef TM_ROW1
#undef TM_ROW2

// The tile's 6 bfloat16 weight rows widened into float32 rows (row stride K), the next tile's rows
// prefetched meanwhile: the tile then broadcasts each weight by one load, where a bfloat16 weight
// broadcast from its own bits takes a load, a shuffle and a shift. Done once per tile for all panels.
inline void widen_rows(const c10::BFloat16* w, int64_t K, float* out) {
  for (int r = 0; r < NR; ++r) {
    const c10::BFloat16* src = w + r * K;
    for (int64_t k = 0; k < K; k += 32) {  // a line at a time, with the same line of the next tile's row
      _mm_prefetch(reinterpret_cast<const char*>(src + NR * K + k), _MM_HINT_T0);  // past the end: a hint
      to_float(src + k, out + r * K + k, std::min<int64_t>(32, K - k));
    }
  }
}

// y[:, :n_full] for x [M, K] (row stride x_row) and N weight rows, n_full = N rounded down to whole
// tiles (returned; the caller computes the rest): weight rows in tiles of NR split between the threads,
// each tile against every panel in turn (its rows from L1 after the first). `rows(n0, scratch)` gives
// the tile's NR rows from n0 (row stride K): the weights themselves (STREAM) or widened to float32
// into `scratch` (NR x K floats, the thread's own), once per tile for all the panels.
template <bool STREAM, typename T, typename Rows>
int64_t linear_tiles(const float* x, int64_t x_row, int64_t M, int64_t N, int64_t K, Rows rows_of, const T* bias,
                     T* y, int64_t y_row) {
  const int64_t count = (M + MP - 1) / MP, tiles = N / NR;
  std::vector<float> panels(count * K * MP);
  tm_panels::pack_x<MP>(x, x_row, M, K, panels.data());
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (NR * K));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(STREAM ? 0 : NR * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NR;
      const T* bt = bias ? bias + n0 : nullptr;
      const auto* wt = rows_of(n0, scratch.data());
      for (int64_t p = 0; p < count; ++p) {
        const int64_t rows = std::min<int64_t>(MP, M - p * MP);
        const float* panel = panels.data() + p * K * MP;
        T* yt = y + p * MP * y_row + n0;
        if (rows > 8)
          tile<2, STREAM>(wt, K, panel, rows, yt, y_row, bt);
        else
          tile<1, STREAM>(wt, K, panel, rows, yt, y_row, bt);
      }
    }
  });
  return tiles * NR;
}

// y[:, :n_full] for w [N, K] in float32 or bfloat16 (widened a tile at a time, unless TM_BF16_DIRECT).
template <typename T>
int64_t linear(const float* x, int64_t x_row, int64_t M, const T* w, int64_t N, int64_t K, const T* bias, T* y,
               int64_t y_row) {
#if !defined(TM_BF16_DIRECT)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const auto widened = [&](int64_t n0, float* scratch) -> const float* {
      widen_rows(w + n0 * K, K, scratch);
      return scratch;
    };
    return linear_tiles<false>(x, x_row, M, N, K, widened, bias, y, y_row);
  }
#endif
  const auto direct = [&](int64_t n0, float*) -> const T* { return w + n0 * K; };
  return linear_tiles<true>(x, x_row, M, N, K, direct, bias, y, y_row);
}

// y[:, :n_full] for int8 weights q [N, K] with float32 scales [N, K / group] (W = q * scale; group = K:
// one scale a row): each tile's rows widened to float32 and scaled once for all the panels, so a
// prompt's product runs the float32 tiles above without a dense copy of the layer.
template <typename T>
int64_t linear_int8(const float* x, int64_t x_row, int64_t M, const int8_t* q, const float* scales, int64_t group,
                    int64_t N, int64_t K, const T* bias, T* y, int64_t y_row) {
  const int64_t G = K / group;
  const int shift = group == K ? 0 : std::countr_zero(static_cast<uint64_t>(group));  // else a power of two
  const auto widened = [&](int64_t n0, float* scratch) -> const float* {
    for (int r = 0; r < NR; ++r) {
      const int8_t* src = q + (n0 + r) * K;
      const float* s = scales + (n0 + r) * G;
      float* dst = scratch + r * K;
      const auto scale_at = [&](int64_t k) { return G == 1 ? s[0] : s[k >> shift]; };
      int64_t k = 0;
      for (; k + 8 <= K; k += 8) {  // the next tile's row a line ahead (past the end: a hint)
        if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(src + NR * K + k), _MM_HINT_T0);
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + k));
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        _mm256_storeu_ps(dst + k, _mm256_mul_ps(v, _mm256_set1_ps(scale_at(k))));
      }
      for (; k < K; ++k) dst[k] = static_cast<float>(src[k]) * scale_at(k);
    }
    return scratch;
  };
  return linear_tiles<false>(x, x_row, M, N, K, widened, bias, y, y_row);
}

}  // namespace tm_broadcast

#endif

// AVX-512, float32 weights, 16 rows and more: the same outer products with 16 float32 lanes. A panel
// is 32 x rows (two vectors), a tile 12 weight rows: 24 accumulators, each weight broadcast by the
// FMA's own memory operand. The peer model's weights at 9-256 rows against the dot-product tiles and
// torch's GEMM (results/linear_variants_amx_tiles512.json): from 16 rows on, faster than the
// dot-product tiles, and ahead of both up to 64 rows (at 9 rows a panel of 32 is mostly zeros: the
// dot-product tiles stay there).
#if defined(__AVX512F__) && !defined(TM_NO_BROADCAST)
#define TM_BROADCAST_TILES_512 1

namespace tm_broadcast512 {

constexpr int NR = 12;  // weight rows per tile
constexpr int MP = 32;  // x rows per panel: two vectors of 16
constexpr int64_t MIN_ROWS = 16;  // fewer rows take linear.cpp's dot-product tiles

// every row of the tile at kk (x0, x1: the panel's vectors at kk)
#define TM_ROWS512_2 \
    { const __m512 b = _mm512_set1_ps(w0[kk]); c00 = _mm512_fmadd_ps(b, x0, c00); c01 = _mm512_fmadd_ps(b, x1, c01); } \
    { const __m512 b = _mm512_set1_ps(w1[kk]); c10 = _mm512_fmadd_ps(b, x0, c10); c11 = _mm512_fmadd_ps(b, x1, c11); } \
    { const __m512 b = _mm512_set1_ps(w2[kk]); c20 = _mm512_fmadd_ps(b, x0, c20); c21 = _mm512_fmadd_ps(b, x1, c21); } \
    { const __m512 b = _mm512_set1_ps(w3[kk]); c30 = _mm512_fmadd_ps(b, x0, c30); c31 = _mm512_fmadd_ps(b, x1, c31); } \
    { const __m512 b = _mm512_set1_ps(w4[kk]); c40 = _mm512_fmadd_ps(b, x0, c40); c41 = _mm512_fmadd_ps(b, x1, c41); } \
    { const __m512 b = _mm512_set1_ps(w5[kk]); c50 = _mm512_fmadd_ps(b, x0, c50); c51 = _mm512_fmadd_ps(b, x1, c51); } \
    { const __m512 b = _mm512_set1_ps(w6[kk]); c60 = _mm512_fmadd_ps(b, x0, c60); c61 = _mm512_fmadd_ps(b, x1, c61); } \
    { const __m512 b = _mm512_set1_ps(w7[kk]); c70 = _mm512_fmadd_ps(b, x0, c70); c71 = _mm512_fmadd_ps(b, x1, c71); } \
    { const __m512 b = _mm512_set1_ps(w8[kk]); c80 = _mm512_fmadd_ps(b, x0, c80); c81 = _mm512_fmadd_ps(b, x1, c81); } \
    { const __m512 b = _mm512_set1_ps(w9[kk]); c90 = _mm512_fmadd_ps(b, x0, c90); c91 = _mm512_fmadd_ps(b, x1, c91); } \
    { const __m512 b = _mm512_set1_ps(w10[kk]); c100 = _mm512_fmadd_ps(b, x0, c100); c101 = _mm512_fmadd_ps(b, x1, c101); } \
    { const __m512 b = _mm512_set1_ps(w11[kk]); c110 = _mm512_fmadd_ps(b, x0, c110); c111 = _mm512_fmadd_ps(b, x1, c111); }
#define TM_ROWS512_1 \
    { const __m512 b = _mm512_set1_ps(w0[kk]); c00 = _mm512_fmadd_ps(b, x0, c00); } \
    { const __m512 b = _mm512_set1_ps(w1[kk]); c10 = _mm512_fmadd_ps(b, x0, c10); } \
    { const __m512 b = _mm512_set1_ps(w2[kk]); c20 = _mm512_fmadd_ps(b, x0, c20); } \
    { const __m512 b = _mm512_set1_ps(w3[kk]); c30 = _mm512_fmadd_ps(b, x0, c30); } \
    { const __m512 b = _mm512_set1_ps(w4[kk]); c40 = _mm512_fmadd_ps(b, x0, c40); } \
    { const __m512 b = _mm512_set1_ps(w5[kk]); c50 = _mm512_fmadd_ps(b, x0, c50); } \
    { const __m512 b = _mm512_set1_ps(w6[kk]); c60 = _mm512_fmadd_ps(b, x0, c60); } \
    { const __m512 b = _mm512_set1_ps(w7[kk]); c70 = _mm512_fmadd_ps(b, x0, c70); } \
    { const __m512 b = _mm512_set1_ps(w8[kk]); c80 = _mm512_fmadd_ps(b, x0, c80); } \
    { const __m512 b = _mm512_set1_ps(w9[kk]); c90 = _mm512_fmadd_ps(b, x0, c90); } \
    { const __m512 b = _mm512_set1_ps(w10[kk]); c100 = _mm512_fmadd_ps(b, x0, c100); } \
    { const __m512 b = _mm512_set1_ps(w11[kk]); c110 = _mm512_fmadd_ps(b, x0, c110); }

// y[i, r] for the 12 weight rows from w (row stride K) and a panel (rows of its 32 real); NV = 2: both
// vectors, NV = 1: the first only (at most 16 real rows).
template <int NV>
inline void tile(const float* w, int64_t K, const float* panel, int64_t rows, float* y, int64_t y_row,
                 const float* bias) {
  const float *w0 = w + 0 * K, *w1 = w + 1 * K, *w2 = w + 2 * K, *w3 = w + 3 * K, *w4 = w + 4 * K, *w5 = w + 5 * K, *w6 = w + 6 * K, *w7 = w + 7 * K, *w8 = w + 8 * K, *w9 = w + 9 * K, *w10 = w + 10 * K, *w11 = w + 11 * K;
  __m512 c00 = _mm512_setzero_ps(), c01 = _mm512_setzero_ps(),c10 = _mm512_setzero_ps(), c11 = _mm512_setzero_ps(),c20 = _mm512_setzero_ps(), c21 = _mm512_setzero_ps(),c30 = _mm512_setzero_ps(), c31 = _mm512_setzero_ps(),c40 = _mm512_setzero_ps(), c41 = _mm512_setzero_ps(),c50 = _mm512_setzero_ps(), c51 = _mm512_setzero_ps(),c60 = _mm512_setzero_ps(), c61 = _mm512_setzero_ps(),c70 = _mm512_setzero_ps(), c71 = _mm512_setzero_ps(),c80 = _mm512_setzero_ps(), c81 = _mm512_setzero_ps(),c90 = _mm512_setzero_ps(), c91 = _mm512_setzero_ps(),c100 = _mm512_setzero_ps(), c101 = _mm512_setzero_ps(),c110 = _mm512_setzero_ps(), c111 = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (k % 16 == 0)  // the next tile's rows, a line ahead (a prefetch past the end is a hint)
      for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (r + NR) * K + k), _MM_HINT_T0);
    const int64_t kk = k;
    const __m512 x0 = _mm512_loadu_ps(panel + k * MP);
    if constexpr (NV == 2) {
      const __m512 x1 = _mm512_loadu_ps(panel + k * MP + 16);
      TM_ROWS512_2
    } else {
      TM_ROWS512_1
    }
  }
  const __m512 acc[2 * NR] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51, c60, c61, c70, c71, c80, c81, c90, c91, c100, c101, c110, c111};
  for (int r = 0; r < NR; ++r) {
    alignas(64) float sums[MP];
    _mm512_store_ps(sums, acc[r * 2]);
    if (NV == 2) _mm512_store_ps(sums + 16, acc[r * 2 + 1]);
    const float b = bias ? bias[r] : 0.f;
    for (int64_t i = 0; i < rows; ++i) y[i * y_row + r] = sums[i] + b;
  }
}
#undef TM_ROWS512_1
#undef TM_ROWS512_2

// y[:, :n_full] for x [M, K] and float32 w [N, K], n_full = N rounded down to whole tiles (returned).
inline int64_t linear(const float* x, int64_t x_row, int64_t M, const float* w, int64_t N, int64_t K,
                      const float* bias, float* y, int64_t y_row) {
  const int64_t count = (M + MP - 1) / MP, tiles = N / NR;
  std::vector<float> panels(count * K * MP);
  tm_panels::pack_x<MP>(x, x_row, M, K, panels.data());
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (NR * K));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NR;
      for (int64_t p = 0; p < count; ++p) {
        const int64_t rows = std::min<int64_t>(MP, M - p * MP);
        const float* panel = panels.data() + p * K * MP;
        if (rows > 16)
          tile<2>(w + n0 * K, K, panel, rows, y + p * MP * y_row + n0, y_row, bias ? bias + n0 : nullptr);
        else
          tile<1>(w + n0 * K, K, panel, rows, y + p * MP * y_row + n0, y_row, bias ? bias + n0 : nullptr);
      }
    }
  });
  return tiles * NR;
}

}  // namespace tm_broadcast512

#endif

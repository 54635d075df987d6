// linear.cpp's few-row path with the input rows kept in L1 (`rows_kblocked`): on AVX2, 5-8 x rows
// (bfloat16 weights: 5-10, linear.cpp's seq_rows; TM_KBLOCK_MIN sets the first) against a thread's
// weight rows, K in slices of KBK columns.
// Why: the one-row-at-a-time walk (linear.cpp `rows_one_by_one`) reads all of x for every weight row.
// 8 float32 x rows of K = 2048 are 64 KB (of K = 5632, 176 KB), past a Zen 3 core's 32 KB L1, so each
// weight vector's 8 FMAs waited on 8 x vectors from L2 (~32 bytes a cycle there: ~8 cycles a step where
// the FMAs take 4). Here a slice of KBK columns of every x row (8 x 256 floats: 8 KB) stays in L1 while
// a block of NBK weight rows passes it, each weight row's slice read once from memory and widened once
// (bfloat16 by a 16-bit shift), every FMA against x from L1. The block's float32 partial sums live in
// `acc` [NBK][MM] until the last slice. Software prefetch follows the walk (row j + PF of the slice,
// then the first rows of the next slice or block): the walk is NBK strided streams, which the hardware
// prefetcher does not follow as it does one sequential stream.
// x of bfloat16 products comes widened with its rows padded (linear.cpp `linear`): rows 8 KB apart met
// in the same L1 sets. Included by linear.cpp inside its anonymous namespace, after Lanes and store_sums.
#pragma once

#ifndef TM_KBLOCK_MIN
#if defined(__AVX512F__)
#define TM_KBLOCK_MIN 9  // not timed on AVX-512 yet: off (its 32 KB of x hold twice the rows of bfloat16 x)
#else
// from 5 rows: on Zen 3 the 1.1B model's bfloat16 products at 8 rows took ~0.7x the time, 0.8x at 5
// (benchmarks/dense_rows.py, results/dense_rows_zen3*.json; float32 0.89-0.92x at 5 and 8 rows);
// from 3 rows on, 4 rows took 1.2x (4 x rows of K = 2048 fit L1 well enough there)
#define TM_KBLOCK_MIN 5
#endif
#endif
#ifndef TM_KBLOCK_K
#define TM_KBLOCK_K 256  // columns a slice: 8 float32 x rows of it are 8 KB, a quarter of a Zen 3 L1 (512: a
                         // little slower at 8 rows; 128: slower at 5 and 8 rows)
#endif
#ifndef TM_KBLOCK_ROWS
#define TM_KBLOCK_ROWS 64  // weight rows a block: each slice of x is reloaded from L2 once per block (32 and
                           // 128 alike)
#endif
#ifndef TM_KBLOCK_PF
#define TM_KBLOCK_PF 4  // prefetch distance in weight-row slices along the walk (2: slower, 8: alike)
#endif
constexpr int64_t KBLOCK_MIN = TM_KBLOCK_MIN, KBK = TM_KBLOCK_K, NBK = TM_KBLOCK_ROWS, KPF = TM_KBLOCK_PF;

// acc[r * acc_row + m] += sum over k < kc of w[r * w_row + k] * x[m * x_row + k] for RR weight rows
// slices and MM x rows; `pf[r]`: the weight slices to prefetch meanwhile (a line per line of w read),
// none where PF is false.
template <int RR, int MM, bool PF, typename T, typename X>
inline void kblock_tile(const T* w, int64_t w_row, int64_t kc, const X* x, int64_t x_row, const T* const* pf,
                        float* acc, int64_t acc_row) {
  typename Lanes::V a[RR][MM];
  for (int r = 0; r < RR; ++r)
    for (int m = 0; m < MM; ++m) a[r][m] = Lanes::zero();
  constexpr int64_t line = std::max<int64_t>(Lanes::W, 64 / sizeof(T));  // weights a cache line
  int64_t k = 0;
  for (; k + line <= kc; k += line) {
    if constexpr (PF)
      for (int r = 0; r < RR; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf[r] + k), TM_PREFETCH_HINT);
    for (int64_t u = 0; u < line; u += Lanes::W)
      for (int r = 0; r < RR; ++r) {
        const typename Lanes::V wv = Lanes::load(w + r * w_row + k + u);
        for (int m = 0; m < MM; ++m) a[r][m] = Lanes::fma(wv, Lanes::load(x + m * x_row + k + u), a[r][m]);
      }
  }
  for (; k + Lanes::W <= kc; k += Lanes::W)
    for (int r = 0; r < RR; ++r) {
      const typename Lanes::V wv = Lanes::load(w + r * w_row + k);
      for (int m = 0; m < MM; ++m) a[r][m] = Lanes::fma(wv, Lanes::load(x + m * x_row + k), a[r][m]);
    }
  float sums[RR * MM];
  store_sums<RR, MM, MM>(a, sums);
  for (; k < kc; ++k)  // the tail shorter than a vector
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < MM; ++m)
        sums[r * MM + m] += static_cast<float>(w[r * w_row + k]) * static_cast<float>(x[m * x_row + k]);
  for (int r = 0; r < RR; ++r)
    for (int m = 0; m < MM; ++m) acc[r * acc_row + m] += sums[r * MM + m];
}

// y[:, n0:n0 + rows] for MM x rows: the thread's weight rows w (from row n0, row stride K) in blocks
// of NBK, each block walked slice by slice (KBK columns), one weight row against every x row at a
// time (two rows against 4 x rows, then against the rest, was no faster at 8 rows and slower at 5-6;
// each group of 4 rows widened once into L1 for linear.cpp's 4 x 3 tiles was slower at 8 rows:
// results/dense_rows_zen3_pairs.json, dense_rows_zen3_variants.json).
template <int MM, typename T, typename X>
void rows_kblocked(const T* w, const T* bias, int64_t n0, int64_t rows, int64_t K, const X* x, int64_t x_row, T* y,
                   int64_t y_row) {
  float acc[NBK][MM];
  for (int64_t nb = 0; nb < rows; nb += NBK) {
    const int64_t nn = std::min(NBK, rows - nb);
    for (int64_t j = 0; j < nn; ++j)
      for (int m = 0; m < MM; ++m) acc[j][m] = 0.f;
    for (int64_t k0 = 0; k0 < K; k0 += KBK) {
      const int64_t kc = std::min(KBK, K - k0);
      // the slice KPF steps further along the walk than row j: this slice's row j + KPF, else the next
      // slice's (or, after the last slice, the next block's) first rows (past the end: a hint, not an access)
      const auto ahead = [&](int64_t j) {
        const int64_t a = j + KPF;
        return a < nn ? w + (nb + a) * K + k0 : k0 + KBK < K ? w + (nb + a - nn) * K + k0 + KBK : w + (nb + a) * K;
      };
      for (int64_t j = 0; j < nn; ++j) {
        const T* pf[1] = {ahead(j)};
        kblock_tile<1, MM, true>(w + (nb + j) * K + k0, K, kc, x + k0, x_row, pf, acc[j], MM);
      }
    }
    for (int64_t j = 0; j < nn; ++j) {
      const float b = bias ? static_cast<float>(bias[n0 + nb + j]) : 0.f;
      for (int m = 0; m < MM; ++m) y[m * y_row + n0 + nb + j] = from_float<T>(acc[j][m] + b);
    }
  }
}

// linear.cpp's few-row path with the input rows kept in L1 (`rows_kblocked`): 5-8 x rows (by default;
// TM_KBLOCK_MIN sets the first) against a thread's weight rows, K in slices of KB.
// Why: the one-row-at-a-time walk (linear.cpp `rows_one_by_one`) reads all of x for every weight row.
// 8 float32 x rows of K = 2048 are 64 KB (of K = 5632, 176 KB), past a Zen 3 core's 32 KB L1, so each
// weight vector's 8 FMAs waited on 8 x vectors from L2 (~32 bytes a cycle there: ~8 cycles a step where
// the FMAs take 4). Here a slice of KB columns of every x row (8 x 512 floats: 16 KB) stays in L1 while
// a block of NBK weight rows passes it, each weight row's slice read once from memory and widened once
// (bfloat16 by a 16-bit shift), every FMA against x from L1. The block's float32 partial sums live in
// `acc` [NBK][MM] until the last slice. Software prefetch follows the walk (row j + PF of the slice,
// then the first rows of the next slice or block): the walk is NBK strided streams, which the hardware
// prefetcher does not follow as it does one sequential stream.
// Included by linear.cpp inside its anonymous namespace, after Lanes and store_sums.
#pragma once

#ifndef TM_KBLOCK_MIN
#if defined(__AVX512F__)
#define TM_KBLOCK_MIN 9  // not timed on AVX-512 yet: off (its 32 KB of x hold twice the rows of bfloat16 x)
#else
#define TM_KBLOCK_MIN 9  // off until timed here (side-by-side builds set 1-8: from that many rows on)
#endif
#endif
#ifndef TM_KBLOCK_K
#define TM_KBLOCK_K 512  // columns a slice: 8 float32 x rows of it are 16 KB, half of a Zen 3 L1
#endif
#ifndef TM_KBLOCK_ROWS
#define TM_KBLOCK_ROWS 64  // weight rows a block: each slice of x is reloaded from L2 once per block
#endif
#ifndef TM_KBLOCK_PF
#define TM_KBLOCK_PF 4  // prefetch distance in weight-row slices along the walk
#endif
constexpr int64_t KBLOCK_MIN = TM_KBLOCK_MIN, KBK = TM_KBLOCK_K, NBK = TM_KBLOCK_ROWS, KPF = TM_KBLOCK_PF;

// acc[m] += sum over k < kc of w[k] * x[m * x_row + k] for MM x rows (one weight row's slice);
// `pf`: the weight slice to prefetch meanwhile (a line per line of w read).
template <int MM, typename T, typename X>
inline void kblock_row(const T* w, int64_t kc, const X* x, int64_t x_row, const T* pf, float* acc) {
  typename Lanes::V a[1][MM];
  for (int m = 0; m < MM; ++m) a[0][m] = Lanes::zero();
  constexpr int64_t line = std::max<int64_t>(Lanes::W, 64 / sizeof(T));  // weights a cache line
  int64_t k = 0;
  for (; k + line <= kc; k += line) {
    _mm_prefetch(reinterpret_cast<const char*>(pf + k), TM_PREFETCH_HINT);
    for (int64_t u = 0; u < line; u += Lanes::W) {
      const typename Lanes::V wv = Lanes::load(w + k + u);
      for (int m = 0; m < MM; ++m) a[0][m] = Lanes::fma(wv, Lanes::load(x + m * x_row + k + u), a[0][m]);
    }
  }
  for (; k + Lanes::W <= kc; k += Lanes::W) {
    const typename Lanes::V wv = Lanes::load(w + k);
    for (int m = 0; m < MM; ++m) a[0][m] = Lanes::fma(wv, Lanes::load(x + m * x_row + k), a[0][m]);
  }
  float sums[MM];
  store_sums<1, MM, MM>(a, sums);
  for (; k < kc; ++k)  // the tail shorter than a vector
    for (int m = 0; m < MM; ++m) sums[m] += static_cast<float>(w[k]) * static_cast<float>(x[m * x_row + k]);
  for (int m = 0; m < MM; ++m) acc[m] += sums[m];
}

// y[:, n0:n0 + rows] for MM x rows: the thread's weight rows w (from row n0, row stride K) in blocks
// of NBK, each block walked slice by slice (KBK columns), row by row within a slice.
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
      for (int64_t j = 0; j < nn; ++j) {
        // the slice KPF steps further along the walk: this slice's row j + KPF, else the next slice's
        // (or, after the last slice, the next block's) first rows (past the end: a hint, not an access)
        const int64_t ahead = j + KPF;
        const T* pf = ahead < nn ? w + (nb + ahead) * K + k0
                      : k0 + KBK < K ? w + (nb + ahead - nn) * K + k0 + KBK
                                     : w + (nb + nn + ahead - nn) * K;
        kblock_row<MM>(w + (nb + j) * K + k0, kc, x + k0, x_row, pf, acc[j]);
      }
    }
    for (int64_t j = 0; j < nn; ++j) {
      const float b = bias ? static_cast<float>(bias[n0 + nb + j]) : 0.f;
      for (int m = 0; m < MM; ++m) y[m * y_row + n0 + nb + j] = from_float<T>(acc[j][m] + b);
    }
  }
}

// The same walk with the weights widened once into L1 (`TM_KBLOCK_WIDEN` builds, for side-by-side
// timings): each group of R weight rows' slice is widened to float32 into `scratch` [R][KBK], then
// meets the x rows MB at a time in linear.cpp's dot-product tiles (R x MB accumulators: fewer loads
// an FMA than one weight row against every x row), partial sums in acc [M][NBK].
template <typename X>
void rows_kblocked_tiles(const bf16* w, const bf16* bias, int64_t n0, int64_t rows, int64_t K, const X* x,
                         int64_t x_row, int64_t M, bf16* y, int64_t y_row) {
  std::vector<float> acc(M * NBK);
  alignas(64) float scratch[R * KBK];
  for (int64_t nb = 0; nb < rows; nb += NBK) {
    const int64_t nn = std::min(NBK, rows - nb);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t k0 = 0; k0 < K; k0 += KBK) {
      const int64_t kc = std::min(KBK, K - k0);
      for (int64_t j = 0; j < nn; j += R) {
        const int rr = static_cast<int>(std::min<int64_t>(R, nn - j));
        for (int r = 0; r < rr; ++r) {  // widened a line at a time, the walk's slice KPF rows on prefetched
          const int64_t ahead = j + r + KPF;
          const bf16* pf = ahead < nn ? w + (nb + ahead) * K + k0
                           : k0 + KBK < K ? w + (nb + ahead - nn) * K + k0 + KBK
                                          : w + (nb + ahead) * K;
          const bf16* src = w + (nb + j + r) * K + k0;
          for (int64_t k = 0; k < kc; k += 32) {
            _mm_prefetch(reinterpret_cast<const char*>(pf + k), TM_PREFETCH_HINT);
            to_float(src + k, scratch + r * KBK + k, std::min<int64_t>(32, kc - k));
          }
        }
        for (int64_t m0 = 0; m0 < M;) {  // as rows_blocked: a remainder past MB split in two
          const int64_t left = M - m0;
          const int mm = static_cast<int>(left > 2 * MB ? MB : left > MB ? (left + 1) / 2 : left);
          add_tile(rr, mm, scratch, KBK, kc, x + m0 * x_row + k0, x_row, acc.data() + m0 * nn + j, nn);
          m0 += mm;
        }
      }
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < nn; ++j) {
        const float b = bias ? static_cast<float>(bias[n0 + nb + j]) : 0.f;
        y[m * y_row + n0 + nb + j] = from_float<bf16>(acc[m * nn + j] + b);
      }
  }
}

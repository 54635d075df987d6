// Linear layers in bfloat16 on AMX (Intel's tile matrix unit), 8 to 32 x rows: y [M, N] = x [M, K] @
// w[N, K]^T, float32 sums. The weights stay in their checkpoint layout: each block of 16 weight rows x
// 32 k is turned into the tile layout AMX multiplies (pairs of k for each of the 16 rows, a 16 x 16
// transpose of 32-bit pairs, in registers) as it is read, so nothing is repacked at load and the same
// tensor serves every other path. One tile holds up to 16 x rows by 32 k; each thread takes whole
// blocks of 32 output rows (two accumulator tiles). Built where the compiler targets AMX (-march=native
// on such a CPU); used once the kernel has asked Linux for the tile state (arch_prctl), else never.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && !defined(TM_NO_AMX)
#define TM_AMX 1

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace tm_amx {

// x rows this path takes, from the peer model's weights timed against vdpbf16ps dot products and
// torch's GEMM (oneDNN, AMX) at 2-64 rows (benchmarks/linear_variants.py,
// results/linear_variants_amx_bf16.json): fastest of the three from 8 to 32 rows; below 8 the transposes
// cost more than the dot products they save; past 32 the weights are transposed again for every 16 rows,
// and torch's GEMM overtakes it.
constexpr int64_t MIN_ROWS = 8, MAX_ROWS = 32;
constexpr int64_t NB = 32;                      // output rows per block: two tiles of 16

// Whether this process may use the tile registers: Linux grants the state on request, once.
inline bool enabled() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles: 0, 1 accumulators (m rows x 16 float32); 2 x (m rows x 32 bfloat16); 3, 4 weights (16 k pairs
// x 16 rows x 2 bfloat16)
inline void configure(int m) {
  TileConfig cfg;
  for (int t : {0, 1, 2}) cfg.rows[t] = static_cast<uint8_t>(m), cfg.colsb[t] = 64;
  for (int t : {3, 4}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// out[p][n] (32-bit) = the p-th 32-bit element of row n (rows `row_bytes` apart) for 16 rows n and
// 16 elements p: a 16 x 16 transpose of 32-bit elements, the tile layout AMX multiplies (a 16-row x
// 32-k block of bfloat16 weights, k in pairs; or of int8 weights, 64 k in quads).
// transpose16: the same from 16 rows already in registers (r is overwritten).
inline void transpose16(__m512i* r, uint32_t* out) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // 32-bit pairs of rows
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 64-bit pairs
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // now r[4j + q] holds, in each 128-bit lane L, elements (lane L, column 4 * (lane-local)) of rows
  // 4j..4j+3; gather the lanes across the four groups
  for (int q = 0; q < 4; ++q) {
    const __m512i a = _mm512_shuffle_i32x4(r[q], r[4 + q], 0x88), b = _mm512_shuffle_i32x4(r[q], r[4 + q], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0x88), d = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0xDD);
    t[q] = _mm512_shuffle_i32x4(a, c, 0x88);       // lane 0
    t[4 + q] = _mm512_shuffle_i32x4(b, d, 0x88);   // lane 1
    t[8 + q] = _mm512_shuffle_i32x4(a, c, 0xDD);   // lane 2
    t[12 + q] = _mm512_shuffle_i32x4(b, d, 0xDD);  // lane 3
  }
  for (int p = 0; p < 16; ++p) _mm512_store_si512(out + p * 16, t[p]);
}

inline void pack_rows(const char* w, int64_t row_bytes, uint32_t* out) {
  __m512i r[16];
  for (int n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(w + n * row_bytes);
  transpose16(r, out);
}

inline void pack_block(const c10::BFloat16* w, int64_t K, uint32_t* out) {
  pack_rows(reinterpret_cast<const char*>(w), K * 2, out);
}

// y[m, n0:n0 + 32] for x rows [m0, m0 + m) (m <= 16), K a multiple of 32.
inline void block(const c10::BFloat16* x, int64_t x_row, int m, const c10::BFloat16* w, int64_t K, float* sums,
                  uint32_t* packed) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k = 0; k < K; k += 32) {
    _tile_loadd(2, x + k, x_row * 2);
    pack_block(w + k, K, packed);
    pack_block(w + 16 * K + k, K, packed + 256);
    _tile_loadd(3, packed, 64);
    _tile_loadd(4, packed + 256, 64);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, sums, 128);  // sums[i][0..15]: rows n0..n0+15, sums[i][16..31]: n0+16..n0+31
  _tile_stored(1, sums + 16, 128);
}

// y[:, :n_full] (bfloat16, rounded once) for x [M, K] and w [N, K]; n_full = N rounded down to whole
// blocks (returned; the caller computes the rest). K must be a multiple of 32 (else 0 is returned).
inline int64_t linear(const c10::BFloat16* x, int64_t x_row, int64_t M, const c10::BFloat16* w, int64_t N, int64_t K,
                      const c10::BFloat16* bias, c10::BFloat16* y, int64_t y_row) {
  if (K % 32 != 0 || !enabled()) return 0;
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t packed[512];
    alignas(64) float sums[16 * NB];
    int configured = 0;
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int m = static_cast<int>(std::min<int64_t>(16, M - m0));
      if (m != configured) configure(m), configured = m;
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * NB;
        block(x + m0 * x_row, x_row, m, w + n0 * K, K, sums, packed);
        for (int i = 0; i < m; ++i)
          for (int j = 0; j < NB; ++j) {
            const float v = sums[i * NB + j] + (bias ? static_cast<float>(bias[n0 + j]) : 0.f);
            y[(m0 + i) * y_row + n0 + j] = c10::BFloat16(v);
          }
      }
    }
    if (configured) _tile_release();
  });
  return blocks * NB;
}


// tiles: 0, 1 sums of x rows 0-15 (weight halves 0, 1), 2, 3 of x rows 16-31, 4, 5 x, 6, 7 weights
// (64 bytes a row each: 16 float32 or int32 sums, 32 bfloat16 or 64 int8 k)
inline void configure_panels(int m0, int m1) {
  TileConfig cfg;
  for (int t : {0, 1, 4}) cfg.rows[t] = static_cast<uint8_t>(m0), cfg.colsb[t] = 64;
  if (m1 > 0)
    for (int t : {2, 3, 5}) cfg.rows[t] = static_cast<uint8_t>(m1), cfg.colsb[t] = 64;
  for (int t : {6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}


// The two-panel loop both quantized AMX paths run: for each block of 32 weight rows, up to 32 x rows
// at a time (two x tiles of 16 rows, four accumulator tiles), each k step's weights put into the tile
// layout once by fill(n0, k, packed) (512 32-bit elements: two halves of 16 rows), then multiplied by
// tdpbssd (INT8: int8 x, 64 k a step, int32 sums) or tdpbf16ps (bfloat16 x, 32 k, float32 sums).
// out(m, n, sum) takes each sum. x rows are x_row_bytes apart. Returns N rounded down to whole blocks
// (the caller computes the rest), 0 where the tiles are not granted.
template <bool INT8, typename Fill, typename Out>
inline int64_t panels(const char* x, int64_t x_row_bytes, int64_t M, int64_t N, int64_t K, Fill fill, Out out) {
  constexpr int64_t KSTEP = INT8 ? 64 : 32;
  using Sum = std::conditional_t<INT8, int32_t, float>;
  if (K % KSTEP != 0 || !enabled()) return 0;
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t packed[512];
    alignas(64) Sum sums[32 * NB];
    int shape0 = 0, shape1 = -1;
    for (int64_t p0 = 0; p0 < M; p0 += 32) {
      const int count = static_cast<int>(std::min<int64_t>(32, M - p0));
      const int m0 = std::min(count, 16), m1 = count - m0;
      if (m0 != shape0 || m1 != shape1) configure_panels(m0, m1), shape0 = m0, shape1 = m1;
      const char* xp = x + p0 * x_row_bytes;
      for (int64_t b = begin; b < end; ++b) {
        const int64_t n0 = b * NB;
        _tile_zero(0);
        _tile_zero(1);
        if (m1 > 0) {
          _tile_zero(2);
          _tile_zero(3);
        }
        for (int64_t k = 0; k < K; k += KSTEP) {
          fill(n0, k, packed);
          _tile_loadd(6, packed, 64);
          _tile_loadd(7, packed + 256, 64);
          const char* xk = xp + k * (INT8 ? 1 : 2);
          _tile_loadd(4, xk, x_row_bytes);
          // (written out per tile: GCC's tile intrinsics paste their tile numbers into the assembly
          // text, so they take literals, not template parameters)
          if constexpr (INT8) {
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(1, 4, 7);
          } else {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (m1 > 0) {
            _tile_loadd(5, xk + 16 * x_row_bytes, x_row_bytes);
            if constexpr (INT8) {
              _tile_dpbssd(2, 5, 6);
              _tile_dpbssd(3, 5, 7);
            } else {
              _tile_dpbf16ps(2, 5, 6);
              _tile_dpbf16ps(3, 5, 7);
            }
          }
        }
        _tile_stored(0, sums, 128);
        _tile_stored(1, sums + 16, 128);
        if (m1 > 0) {
          _tile_stored(2, sums + 16 * NB, 128);
          _tile_stored(3, sums + 16 * NB + 16, 128);
        }
        for (int i = 0; i < count; ++i)
          for (int j = 0; j < NB; ++j) out(p0 + i, n0 + j, sums[i * NB + j]);
      }
    }
    if (shape1 >= 0) _tile_release();
  });
  return blocks * NB;
}

// Quantized weights on AMX's bfloat16 tiles, any number of bfloat16 x rows: y = x [M, K] @ W^T, W
// made 32 k of a row at a time by rows(n, k) (a register of 32 bfloat16: int8 values as they are,
// exact, or dequantized with their scale), transposed into the tile layout once for up to 32 x rows,
// float32 sums to out(m, n, sum). K a multiple of 32.
template <typename Rows, typename Out>
inline int64_t linear_rows_bf16(const c10::BFloat16* x, int64_t x_row, int64_t M, int64_t N, int64_t K, Rows rows,
                                Out out) {
  const auto fill = [&](int64_t n0, int64_t k, uint32_t* packed) {
    __m512i r[16];
    for (int half = 0; half < 2; ++half) {
      for (int i = 0; i < 16; ++i) r[i] = rows(n0 + 16 * half + i, k);
      transpose16(r, packed + 256 * half);
    }
  };
  return panels<false>(reinterpret_cast<const char*>(x), x_row * 2, M, N, K, fill, out);
}

// 32 float32 (lo: k 0-15, hi: k 16-31) -> one register of 32 bfloat16 in k order, rounded to nearest.
inline __m512i to_bf16x32(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

#if defined(__AMX_INT8__)
#define TM_AMX_INT8 1
// W8A8 on AMX, any number of x rows: xq [M, K] int8 against q [N, K] int8 (K a multiple of 64), the
// weights put into the tile layout as they are read (pack_rows: 64 k a row), tdpbssd (signed x
// signed), int32 sums to out(m, n, sum).
template <typename Out>
inline int64_t linear_w8a8(const int8_t* xq, int64_t M, const int8_t* q, int64_t N, int64_t K, Out out) {
  const auto fill = [&](int64_t n0, int64_t k, uint32_t* packed) {
    pack_rows(reinterpret_cast<const char*>(q + n0 * K + k), K, packed);
    pack_rows(reinterpret_cast<const char*>(q + (n0 + 16) * K + k), K, packed + 256);
  };
  return panels<true>(reinterpret_cast<const char*>(xq), K, M, N, K, fill, out);
}
#endif
}  // namespace tm_amx

#endif

// attention.cpp's bfloat16 tiles, for CPUs with AVX-512 BF16 (vdpbf16ps: 32 bfloat16 products
// summed into 16 float32 lanes an instruction, twice a float32 FMA's work) and a bfloat16 cache with a
// head size of 64 or 128.
//
// A tile's keys are packed as [head_dim / 2][16]: lane t holds key t's (d, d + 1) pair, so a query's
// (d, d + 1) pair broadcast against a row of them advances 16 scores by two dimensions. Its values as
// [8][head_dim]: lane d of row u holds (v[2u][d], v[2u + 1][d]), and the probabilities of keys 2u and
// 2u + 1, rounded to bfloat16, broadcast as a pair. The scores and the softmax stay in float32; the
// products take the cache's bfloat16 values as they are, and the probabilities are rounded to
// bfloat16 for P x V (as GPU flash attention rounds them), the sums kept in float32.
#pragma once

#if defined(__AVX512BF16__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

namespace tokenmill_bf16 {

constexpr int64_t kLanes = 16;  // keys a tile, float32 lanes a vector

// Two rows of 16 bfloat16s as 16 (a[t], b[t]) pairs.
inline __m512i interleave(__m256i a, __m256i b) {
  alignas(64) static const uint16_t order[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  return _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), _mm512_load_si512(order), _mm512_castsi256_si512(b));
}

// Up to 16 keys and values of one (block, KV head) chunk, packed (keys [dim / 2][16] pairs, values
// [8][dim] pairs; missing keys and values zero).
struct Tile {
  const uint32_t* keys;
  const uint32_t* values;
  int64_t count;
};

inline Tile pack(const c10::BFloat16* k_chunk, const c10::BFloat16* v_chunk, int64_t block_size, int64_t first,
                 int64_t count, int64_t dim, uint32_t* kbuf, uint32_t* vbuf) {
  const __mmask16 some = count >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
  for (int64_t i = 0; i < dim / 2; ++i) {
    const c10::BFloat16* row = k_chunk + 2 * i * block_size + first;  // rows d = 2i and 2i + 1 of [dim, block_size]
    const __m256i a = _mm256_maskz_loadu_epi16(some, row);
    const __m256i b = _mm256_maskz_loadu_epi16(some, row + block_size);
    _mm512_storeu_si512(kbuf + i * kLanes, interleave(a, b));
  }
  for (int64_t u = 0; u < kLanes / 2; ++u) {
    const c10::BFloat16* row = v_chunk + (first + 2 * u) * dim;
    for (int64_t c = 0; c < dim; c += kLanes) {
      const __m256i a = 2 * u < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c))
                                      : _mm256_setzero_si256();
      const __m256i b = 2 * u + 1 < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + dim + c))
                                          : _mm256_setzero_si256();
      _mm512_storeu_si512(vbuf + u * dim + c, interleave(a, b));
    }
  }
  return {kbuf, vbuf, count};
}

// kQ queries' scores against a tile, times `scale`: si[j][t]. q: [kQ][kDim / 2] bfloat16 pairs.
// `next` is called twice a step (the caller's prefetch of the next blocks, a line a call).
template <int64_t kDim, int64_t kQ, typename Next>
inline void scores(const Tile& tile, const uint32_t* q, float scale, float (*si)[kLanes], Next&& next) {
  __m512 acc[kQ];
  for (int64_t j = 0; j < kQ; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < kDim / 2; ++i) {
    next();
    next();
    const __m512bh keys = (__m512bh)_mm512_loadu_si512(tile.keys + i * kLanes);
    for (int64_t j = 0; j < kQ; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[j * kDim / 2 + i])), keys);
  }
  for (int64_t j = 0; j < kQ; ++j) _mm512_storeu_ps(si[j], _mm512_mul_ps(acc[j], _mm512_set1_ps(scale)));
}

// acc[j] (kQ rows of kDim) = acc[j] * correction[j] + P x V over n tiles, p[j][i * 16 + t] the
// probability of tile i's key t (kKeys a row).
template <int64_t kDim, int64_t kQ, int64_t kKeys>
inline void add_values(const Tile* tiles, int64_t n, const float (*p)[kKeys], const float* correction, float* acc) {
  alignas(64) uint32_t pairs[kQ][kKeys / 2];  // (p[2u], p[2u + 1]) in bfloat16
  for (int64_t j = 0; j < kQ; ++j)
    for (int64_t t = 0; t < n * kLanes; t += 2 * kLanes) {
      const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p[j] + t + kLanes), _mm512_loadu_ps(p[j] + t));
      _mm512_store_si512(pairs[j] + t / 2, (__m512i)both);
    }
  for (int64_t c = 0; c < kDim; c += kLanes) {
    __m512 a[kQ];
    for (int64_t j = 0; j < kQ; ++j) a[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * kDim + c), _mm512_set1_ps(correction[j]));
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t u = 0; 2 * u < tiles[i].count; ++u) {
        const __m512bh values = (__m512bh)_mm512_loadu_si512(tiles[i].values + u * kDim + c);
        for (int64_t j = 0; j < kQ; ++j)
          a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[j][i * kLanes / 2 + u])),
                                  values);
      }
    }
    for (int64_t j = 0; j < kQ; ++j) _mm512_storeu_ps(acc + j * kDim + c, a[j]);
  }
}

}  // namespace tokenmill_bf16
#endif

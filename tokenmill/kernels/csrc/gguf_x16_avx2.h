// The 16-row repacked GGUF products (gguf_x16_pack.h's layout) for AVX2 without AVX-512 VNNI: each
// 64-byte line of a group is two 256-bit halves, rows 0-7 and rows 8-15, taken in turn as the line is read.
//
// AVX2 has no vpdpbusd: vpmaddubsw multiplies 4 weights of each of 8 rows (unsigned bytes) with 4
// bytes of x broadcast to every row (signed) into int16 pairs, and the pairs of a few steps are added
// in int16 before vpmaddwd by ones widens them to one int32 a row. The steps a sum may take stay within
// int16: a pair is at most 2 * q * 127 (q <= 15: 3,810; q <= 31: 7,874; q <= 63: 16,002), so 8 steps
// for 4-bit weights (30,480), 4 for 5-bit, 2 for 6-bit. From there the sums are the AVX-512 kernels'
// (gguf_x16.cpp): the run's int32 sum times the rows' scales (vpmulld), the block's float step one fma
// a row of x for 8 rows, in the same order, so that the results are theirs (and the file blocks'
// products', gguf_kdot.h) bit for bit. Q8_0's bytes are stored + 128, up to 255, whose pairs would
// overflow int16: its blocks take the sign step llama.cpp's take (|w| unsigned, x given w's sign),
// each step widened alone.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gguf_kdot.h"
#include "gguf_x16_pack.h"

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__))
#define TM_X16_AVX2 1

namespace tm_x16 {

constexpr int64_t HALF = 32;  // bytes of a line a half (8 rows of 4 bytes)

inline __m256i bcast4_8(const int8_t* p) {  // 4 bytes of x to every row
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256i bytes8_u32(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

// Part `i` of `parts` of the lines of the block two blocks on fetched ahead (the 32-weight types' small
// blocks: ~4.6 KB on). Without it Q5_K's blocks (two streams: the nibbles, then the fifth bits) were
// read from memory at a third of the rate, and every type's passes of 8 x rows at ~0.6 of it.
template <int TYPE>
inline void prefetch_ahead(const uint8_t* gb, int i, int parts) {
  constexpr int64_t GB = group_bytes(TYPE), LINES = (GB + 63) / 64;
  constexpr int64_t AHEAD = block_weights(TYPE) == 256 ? 2 * GB : (4608 / GB + 1) * GB;
  const int64_t first = LINES * i / parts, last = LINES * (i + 1) / parts;
  for (int64_t c = first; c < last; ++c) _mm_prefetch(reinterpret_cast<const char*>(gb + AHEAD + 64 * c), _MM_HINT_T0);
}

// sum over steps i of q[i] . (4 bytes of x at xr + 4 * i), a row's int32 lane; STEP int16 sums at a time
template <int N, int STEP>
inline __m256i steps(const __m256i* q, const int8_t* xr) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i t = _mm256_setzero_si256();
  for (int s = 0; s < N; s += STEP) {
    __m256i p = _mm256_maddubs_epi16(q[s], bcast4_8(xr + 4 * s));
    for (int i = s + 1; i < s + STEP; ++i) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(q[i], bcast4_8(xr + 4 * i)));
    t = _mm256_add_epi32(t, _mm256_madd_epi16(p, ones));
  }
  return t;
}

// Q4_K, Q5_K: a group's block gb, both halves in one pass over its lines (rows 8h .. 8h + 7: facc[h],
// lane r), MM x rows from m0, block b: the block's float step into facc
template <int TYPE, int MM>
inline void q4k_block(const uint8_t* gb, const KX& x, int64_t m0, int64_t b, __m256 (*facc)[MM]) {
  const int64_t K = x.K, NB = K / QK;
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256i acc[2][MM];
  for (int m = 0; m < MM; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_si256();
  for (int R = 0; R < 8; ++R) {  // run R: 32 weights of each row, one scale a row
    prefetch_ahead<TYPE>(gb, R, 8);
    __m256i hb[2];
    if constexpr (TYPE == 13)
      for (int h = 0; h < 2; ++h) hb[h] = ld32(gb + 2368 + 64 * R + HALF * h);
    __m256i p[2][MM], t[2][MM];  // int16 pair sums of the last steps, int32 sums (a row a lane)
    for (int i = 0; i < 4; ++i) {  // line 4R + i: weights 4i + j (low nibbles) and 16 + 4i + j (high)
      __m256i q[2][2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = ld32(gb + (4 * R + i) * 64 + HALF * h);
        q[h][0] = _mm256_and_si256(v, low), q[h][1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if constexpr (TYPE == 13) {  // bit i / 4 + i of the run's fifth-bit line -> bit 4
          const __m256i five = _mm256_set1_epi8(16);
          q[h][0] = _mm256_or_si256(q[h][0], _mm256_and_si256(_mm256_slli_epi16(hb[h], 4 - i), five));
          q[h][1] = _mm256_or_si256(q[h][1], _mm256_and_si256(_mm256_srli_epi16(hb[h], i), five));
        }
      }
      for (int m = 0; m < MM; ++m) {
        const int8_t* xr = x.q.data() + (m0 + m) * K + b * QK + 32 * R;
        const __m256i xl = bcast4_8(xr + 4 * i), xh = bcast4_8(xr + 16 + 4 * i);
        for (int h = 0; h < 2; ++h) {
          const __m256i pp = _mm256_add_epi16(_mm256_maddubs_epi16(q[h][0], xl), _mm256_maddubs_epi16(q[h][1], xh));
          p[h][m] = i == 0 || (TYPE == 13 && i == 2) ? pp : _mm256_add_epi16(p[h][m], pp);
          if (TYPE == 13 && i == 1) t[h][m] = _mm256_madd_epi16(p[h][m], ones);  // (5 bits: 4 steps an int16 sum)
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i sc = bytes8_u32(gb + 2112 + 16 * R + 8 * h);
      for (int m = 0; m < MM; ++m) {
        __m256i sum = _mm256_madd_epi16(p[h][m], ones);
        if constexpr (TYPE == 13) sum = _mm256_add_epi32(sum, t[h][m]);
        acc[h][m] = _mm256_add_epi32(acc[h][m], _mm256_mullo_epi32(sum, sc));
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    __m256i mn[4];  // the mins of runs 2k, 2k + 1 as int16 pairs, a row's pair a lane
    for (int k = 0; k < 4; ++k) mn[k] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 2240 + 32 * k + 16 * h)));
    const __m256 d = halves8(gb + 2048 + 16 * h), nmin = _mm256_xor_ps(halves8(gb + 2080 + 16 * h), _mm256_set1_ps(-0.f));
    for (int m = 0; m < MM; ++m) {
      const int8_t* s32 = reinterpret_cast<const int8_t*>(x.sum32.data() + (m0 + m) * (K / 32) + b * 8);
      __m256i mins = _mm256_madd_epi16(mn[0], bcast4_8(s32));
      for (int k = 1; k < 4; ++k) mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mn[k], bcast4_8(s32 + 4 * k)));
      const __m256 xd = _mm256_set1_ps(x.d[(m0 + m) * NB + b]);
      facc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[h][m]), _mm256_mul_ps(d, xd), facc[h][m]);
      facc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(nmin, xd), facc[h][m]);
    }
  }
}

// Q6_K: a group's block, as q4k_block (each group of 16 weights' lines, both halves in turn)
template <int MM>
inline void q6k_block(const uint8_t* gb, const KX& x, int64_t m0, int64_t b, __m256 (*facc)[MM]) {
  const int64_t K = x.K, NB = K / QK;
  const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
  __m256i acc[2][MM];
  for (int m = 0; m < MM; ++m) acc[0][m] = acc[1][m] = _mm256_setzero_si256();
  for (int G = 0; G < 16; ++G) {  // 16 weights of each row, one scale a row
    prefetch_ahead<14>(gb, G, 16);
    for (int h = 0; h < 2; ++h) {
      const __m256i l0 = ld32(gb + 2 * G * 64 + HALF * h), l1 = ld32(gb + (2 * G + 1) * 64 + HALF * h);
      const __m256i hb = ld32(gb + 2048 + G * 64 + HALF * h);
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(_mm256_slli_epi16(hb, 2), top)),
          _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(hb, top)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), _mm256_and_si256(_mm256_srli_epi16(hb, 2), top))};
      const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(gb + 3072 + 16 * G + 8 * h)));
      for (int m = 0; m < MM; ++m) {
        __m256i t = steps<4, 2>(q, x.q.data() + (m0 + m) * K + b * QK + 16 * G);
        t = _mm256_sub_epi32(t, _mm256_set1_epi32(32 * x.sum16[(m0 + m) * (K / 16) + b * 16 + G]));
        acc[h][m] = _mm256_add_epi32(acc[h][m], _mm256_mullo_epi32(t, sc));
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const __m256 d = halves8(gb + 3328 + 16 * h);
    for (int m = 0; m < MM; ++m) {
      const __m256 xd = _mm256_set1_ps(x.d[(m0 + m) * NB + b]);
      facc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[h][m]), _mm256_mul_ps(d, xd), facc[h][m]);
    }
  }
}

// Q4_0 (q - 8), Q4_1 (d * q + m) and Q8_0 (signed bytes, by the sign step), 32 weights a block: a
// group's block, as q4k_block (its 4 or 8 lines, both halves in turn)
template <int TYPE, int MM>
inline void q32_block(const uint8_t* gb, const X32& x, int64_t m0, int64_t b, __m256 (*facc)[MM]) {
  const int64_t K = x.K, NB = K / 32;
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  prefetch_ahead<TYPE>(gb, 0, 1);
  for (int h = 0; h < 2; ++h) {
    __m256i q[8];
    if constexpr (TYPE != 8) {
      for (int i = 0; i < 4; ++i) {
        const __m256i v = ld32(gb + 64 * i + HALF * h);
        q[i] = _mm256_and_si256(v, low), q[4 + i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
    } else {  // stored w + 128 -> w
      for (int i = 0; i < 8; ++i) q[i] = _mm256_xor_si256(ld32(gb + 64 * i + HALF * h), _mm256_set1_epi8(static_cast<char>(0x80)));
    }
    const __m256 d = halves8(gb + (TYPE == 8 ? 512 : 256) + 16 * h);
    for (int m = 0; m < MM; ++m) {
      const int8_t* xr = x.q.data() + (m0 + m) * K + b * 32;
      __m256i t;
      if constexpr (TYPE != 8) {
        t = steps<8, 8>(q, xr);
        if constexpr (TYPE == 2) t = _mm256_sub_epi32(t, _mm256_set1_epi32(8 * x.s[(m0 + m) * NB + b]));
      } else {  // |w| (<= 128) . x with w's sign, a step's pairs (up to 2 * 128 * 127) widened at once
        t = _mm256_setzero_si256();
        for (int i = 0; i < 8; ++i) {
          const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(q[i]), _mm256_sign_epi8(bcast4_8(xr + 4 * i), q[i]));
          t = _mm256_add_epi32(t, _mm256_madd_epi16(p, ones));
        }
      }
      const float xs = x.d[(m0 + m) * NB + b];
      facc[h][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, _mm256_set1_ps(xs)), facc[h][m]);
      if constexpr (TYPE == 3)
        facc[h][m] = _mm256_fmadd_ps(halves8(gb + 288 + 16 * h), _mm256_set1_ps(xs * static_cast<float>(x.s[(m0 + m) * NB + b])), facc[h][m]);
    }
  }
}

// a group (16 rows, all its blocks) . MM x rows from m0 -> out[m * ROWS + r]
template <int TYPE, int MM, typename X>
void group_avx2(const uint8_t* g, const X& x, int64_t m0, float* out) {
  __m256 facc[2][MM];  // [half][x row]: lane r, row 8 * half + r
  for (int m = 0; m < MM; ++m) facc[0][m] = facc[1][m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.K / block_weights(TYPE); ++b) {
    const uint8_t* gb = g + b * group_bytes(TYPE);
    if constexpr (TYPE == 12 || TYPE == 13)
      q4k_block<TYPE, MM>(gb, x, m0, b, facc);
    else if constexpr (TYPE == 14)
      q6k_block<MM>(gb, x, m0, b, facc);
    else
      q32_block<TYPE, MM>(gb, x, m0, b, facc);
  }
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MM; ++m) _mm256_storeu_ps(out + m * ROWS + 8 * h, facc[h][m]);
}

}  // namespace tm_x16
#endif

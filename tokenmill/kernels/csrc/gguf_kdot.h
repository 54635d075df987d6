// The decode product for GGUF's 256-weight K-quant blocks (Q3_K, Q4_K, Q5_K, Q6_K), in integers a whole
// block at a time (gguf_blocks.cpp dispatches here; the 32-weight types stay there).
//
// x is rounded to int8 per 256 (one float scale xd a block of x, symmetric: |xq| <= 127), with the
// integer sums of xq per 16 and per 32 kept beside. A weight block is d * sc_g * q - dmin * mn_g
// (Q4_K / Q5_K: sc, mn 6-bit per 32, q 4 or 5 bits) or d * sc_g * (q - OFF) (Q6_K: sc int8 per 16, q 6
// bits, OFF 32; Q3_K: sc 6-bit less 32 per 16, q 3 bits, OFF 4), so a block's dot with x's block is
//   xd * (d * sum_g sc_g * (q_g . xq_g) - dmin * sum_g mn_g * sum(xq_g))        (Q4_K, Q5_K)
//   xd * d * (sum_g sc_g * (q_g . xq_g) - OFF * sum_g sc_g * sum(xq_g))         (Q6_K, Q3_K)
// with every sum over g an exact int32: q . xq per pair of bytes by vpmaddubsw (q unsigned <= 63, xq
// signed: |pair| <= 2 * 63 * 127, within int16), the pairs times the scales widened to int16 and summed
// in pairs by vpmaddwd (AVX-512 VNNI: vpdpwssd, the multiply and the add in one), |sum| < 2^26.
//
// The float step, one a block and x row: acc = fma(dot, d * xd, acc), then (Q4_K, Q5_K) acc =
// fma(mins, -dmin * xd, acc), in block order. Several x rows take it together: their int32 sums are
// reduced into one lane a row (an exact integer transpose-and-add), the mins (or Q6_K's offsets) come
// from x's per-32 (per-16) sums laid out 8 rows a register (KX's groups), and 8 rows share one
// conversion and two fmas where each row had its own. One row takes the same fmas in scalar form, so
// a row's value does not depend on how many rows it was computed with.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "convert.h"

namespace tm_gguf {

constexpr int64_t QK = 256;  // weights a K-quant block, x values a scale

inline float half_bits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

inline uint32_t word(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

constexpr int64_t XG = 8;  // x rows a group: the rows a product of several rows takes at once

// x rounded per 256: q [M, K] int8, d [M, K / 256], sum16 [M, K / 16] and sum32 [M, K / 32] (of q);
// and by groups of XG rows (rows past M zero), for each group g and block b: d8 [g, b, 8] (d), s32p
// [g, b, 4, 8, 2] (sum32's pairs k: row m's sums 2k, 2k + 1) and s16p [g, b, 8, 8, 2] (sum16's)
struct KX {
  std::vector<int8_t> q;
  std::vector<float> d, d8;
  std::vector<int16_t> sum16, sum32, s32p, s16p;
  int64_t K = 0;
  void resize(int64_t M, int64_t k) {
    K = k;
    q.resize(M * K), d.resize(M * (K / QK)), sum16.resize(M * (K / 16)), sum32.resize(M * (K / 32));
  }
};

// x rounded per 32 (Q4_0, Q4_1, Q8_0: gguf_x16.cpp): q [M, K] int8, d [M, K / 32] (|q| <= 127, q * d ~ x), s [M, K / 32] (sums of q)
struct X32 {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> s;
  int64_t K = 0;
};

// KX's groups, from its rows (after every row is rounded)
inline void group_rows(KX& x, int64_t M) {
  const int64_t NB = x.K / QK, G = (M + XG - 1) / XG;
  x.d8.assign(G * NB * XG, 0.f), x.s32p.assign(G * NB * 64, 0), x.s16p.assign(G * NB * 128, 0);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t g = m / XG, r = m % XG;
    for (int64_t b = 0; b < NB; ++b) {
      const int64_t gb = g * NB + b;
      x.d8[gb * XG + r] = x.d[m * NB + b];
      for (int i = 0; i < 8; ++i) x.s32p[gb * 64 + (i / 2) * 16 + 2 * r + i % 2] = x.sum32[m * (x.K / 32) + b * 8 + i];
      for (int i = 0; i < 16; ++i) x.s16p[gb * 128 + (i / 2) * 16 + 2 * r + i % 2] = x.sum16[m * (x.K / 16) + b * 16 + i];
    }
  }
}

// x's block b of row m (256 values v) rounded: q, d, the sums of q per 16 and per 32
inline void round_block(const float* v, KX& out, int64_t m, int64_t b) {
  const int64_t K = out.K;
  int8_t* q = out.q.data() + m * K + b * QK;
  int16_t* s16 = out.sum16.data() + m * (K / 16) + b * 16;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < QK; i += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  for (int i = 0; i < QK; i += 32) {  // (vcvtps2dq rounds to nearest even: nearbyint's rounding)
    __m256i n[4];
    for (int j = 0; j < 4; ++j) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * j), inv));
    for (int j = 0; j < 2; ++j) {
      const __m256i t = _mm256_add_epi32(n[2 * j], n[2 * j + 1]);
      __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      u = _mm_hadd_epi32(u, u);
      s16[i / 16 + j] = static_cast<int16_t>(_mm_cvtsi128_si32(_mm_hadd_epi32(u, u)));
    }
    const __m256i b8 = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                        _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
#else
  float amax = 0.f;
  for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int i = 0; i < QK; ++i) q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
  for (int g = 0; g < QK / 16; ++g) {
    int t = 0;
    for (int i = 0; i < 16; ++i) t += q[16 * g + i];
    s16[g] = static_cast<int16_t>(t);
  }
#endif
  out.d[m * (K / QK) + b] = amax / 127.f;
  for (int g = 0; g < QK / 32; ++g) out.sum32[m * (K / 32) + b * 8 + g] = static_cast<int16_t>(s16[2 * g] + s16[2 * g + 1]);
}

// x [M, K] rounded per 256 into `out`, rows in parallel when there are more than a group; `groups`:
// KX's groups too (the products that take several x rows at once read them, one x row does not)
template <typename T>
void quantize_x256(const T* x, int64_t x_row, int64_t M, int64_t K, KX& out, bool groups) {
  out.resize(M, K);
  at::parallel_for(0, M, M > XG ? 16 : std::max<int64_t>(1, M), [&](int64_t begin, int64_t end) {
    alignas(32) float v[QK];
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < K / QK; ++b) {
        to_float(x + m * x_row + b * QK, v, QK);
        round_block(v, out, m, b);
      }
  });
  if (groups) group_rows(out, M);
}

// Q4_K / Q5_K's 12 bytes of 6-bit scales and mins as 8 bytes each (byte r: run r's)
inline void k4_scales(const uint8_t* s, uint64_t& sc, uint64_t& mn) {
  const uint32_t w0 = word(s), w1 = word(s + 4), w2 = word(s + 8);
  sc = (w0 & 0x3f3f3f3fu) | uint64_t{(w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u)} << 32;
  mn = (w1 & 0x3f3f3f3fu) | uint64_t{((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u)} << 32;
}

// Q3_K's 12 scale bytes -> its 16 scales less 32, int8 (4-bit lows in bytes 0-7, their top 2 bits in 8-11)
inline void q3_scales(const uint8_t* s, int8_t* out) {
  uint32_t v[3], sc[4];
  std::memcpy(v, s, 12);
  sc[0] = (v[0] & 0x0f0f0f0fu) | ((v[2] & 0x03030303u) << 4);
  sc[1] = (v[1] & 0x0f0f0f0fu) | (((v[2] >> 2) & 0x03030303u) << 4);
  sc[2] = ((v[0] >> 4) & 0x0f0f0f0fu) | (((v[2] >> 4) & 0x03030303u) << 4);
  sc[3] = ((v[1] >> 4) & 0x0f0f0f0fu) | (((v[2] >> 6) & 0x03030303u) << 4);
  for (int g = 0; g < 16; ++g) out[g] = static_cast<int8_t>(static_cast<int>((sc[g / 4] >> (8 * (g % 4))) & 63) - 32);
}
inline __m128i q3_scales_vec(const uint8_t* s) {
  alignas(16) int8_t v[16];
  q3_scales(s, v);
  return _mm_load_si128(reinterpret_cast<const __m128i*>(v));
}

// ---- scalar: the same integer sums (the reference the vector forms follow) ----
// type 11 / 12 / 13 / 14: Q3_K / Q4_K / Q5_K / Q6_K; one weight row (K / 256 blocks of `bytes`) . x row m
template <int TYPE>
float krow_dot_scalar(const uint8_t* row, const KX& x, int64_t m) {
  const int64_t K = x.K, bytes = TYPE == 11 ? 110 : TYPE == 12 ? 144 : TYPE == 13 ? 176 : 210;
  float acc = 0.f;
  for (int64_t b = 0; b < K / QK; ++b) {
    const uint8_t* p = row + b * bytes;
    const int8_t* xq = x.q.data() + m * K + b * QK;
    const int16_t* s16 = x.sum16.data() + m * (K / 16) + b * 16;
    int32_t dot = 0, mins = 0;
    float d, dmin = 0.f;
    if constexpr (TYPE == 11) {
      int8_t sc[16];
      q3_scales(p + 96, sc);
      d = half_bits(p + 108);
      for (int i = 0; i < QK; ++i) {
        const int r = i / 32, l = i % 32;
        const int q = ((p[32 + 32 * (r / 4) + l] >> (2 * (r % 4))) & 3) | (((p[l] >> r) & 1) << 2);
        dot += sc[i / 16] * q * xq[i];
      }
      for (int g = 0; g < 16; ++g) dot -= 4 * sc[g] * s16[g];
    } else if constexpr (TYPE == 14) {
      d = half_bits(p + 208);
      for (int i = 0; i < QK; ++i) {
        const int h = i / 128, t = (i / 32) % 4, l = i % 32;
        const int q = ((p[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2))) & 15) | (((p[128 + 32 * h + l] >> (2 * t)) & 3) << 4);
        dot += static_cast<int8_t>(p[192 + i / 16]) * q * xq[i];
      }
      for (int g = 0; g < 16; ++g) dot -= 32 * static_cast<int8_t>(p[192 + g]) * s16[g];
    } else {
      uint64_t sc, mn;
      k4_scales(p + 4, sc, mn);
      d = half_bits(p), dmin = half_bits(p + 2);
      const uint8_t* nib = p + (TYPE == 13 ? 48 : 16);
      for (int i = 0; i < QK; ++i) {
        const int r = i / 32;
        int q = (nib[32 * (r / 2) + i % 32] >> (4 * (r % 2))) & 15;
        if constexpr (TYPE == 13) q |= ((p[16 + i % 32] >> r) & 1) << 4;
        dot += static_cast<int>((sc >> (8 * r)) & 255) * q * xq[i];
      }
      for (int r = 0; r < 8; ++r) mins += static_cast<int>((mn >> (8 * r)) & 255) * (s16[2 * r] + s16[2 * r + 1]);
    }
    const float xd = x.d[m * (K / QK) + b];
    acc = std::fma(static_cast<float>(dot), d * xd, acc);
    if constexpr (TYPE == 12 || TYPE == 13) acc = std::fma(static_cast<float>(mins), -dmin * xd, acc);
  }
  return acc;
}

#if defined(__AVX2__) && defined(__FMA__)
#define TM_GGUF_KDOT_AVX2 1
// fma(a, b, c) rounded once, as each lane of a vector fma
inline float fma1(float a, float b, float c) {
  return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
}
inline int32_t hsum_i(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1)));
}
inline int32_t hsum_i(__m256i v) { return hsum_i(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1))); }
// lane m: the sum of v[m]'s int32 lanes (v[m] zero for m >= MM)
template <int MM>
inline __m256i rows8(const __m256i* v) {
  const auto at = [&](int m) { return m < MM ? v[m] : _mm256_setzero_si256(); };
  const __m256i lo = _mm256_hadd_epi32(_mm256_hadd_epi32(at(0), at(1)), _mm256_hadd_epi32(at(2), at(3)));
  const __m256i hi = _mm256_hadd_epi32(_mm256_hadd_epi32(at(4), at(5)), _mm256_hadd_epi32(at(6), at(7)));
  return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}
// 8 rows' madd of a block's int16 scale pairs (pair k: int32 lane k of sc, 8 pairs) with x's grouped sums
// (pairs k: 8 rows a 256 bits): row m's sum over k
inline __m256i pairs8(__m256i sc, const int16_t* pairs, int npairs) {
  __m256i t = _mm256_setzero_si256();
  for (int k = 0; k < npairs; ++k)
    t = _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_permutevar8x32_epi32(sc, _mm256_set1_epi32(k)),
                                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 16 * k))));
  return t;
}
inline __m256i ld32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i ld32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// int16 lanes: the low 128 bits take int16 a of v (a 128-bit lane's 8), the high 128 bits int16 b
inline __m256i pick16(__m256i v, int a, int b) {
  return _mm256_shuffle_epi8(v, _mm256_setr_epi8(2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1,
                                                  2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1,
                                                  2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1,
                                                  2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
// rows8 for 16-lane sums: pairs of rows interleaved, then pairs of pairs, then the four 128-bit lanes added
inline __m512i add2(__m512i a, __m512i b) { return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b)); }
inline __m512i add4(__m512i ab, __m512i cd) { return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd)); }
template <int MM>
inline __m256i rows8(const __m512i* v) {
  const auto at = [&](int m) { return m < MM ? v[m] : _mm512_setzero_si512(); };
  const __m512i r03 = add4(add2(at(0), at(1)), add2(at(2), at(3)));  // a 128-bit lane: rows 0-3's partial sums
  const __m512i r47 = add4(add2(at(4), at(5)), add2(at(6), at(7)));
  const __m512i t = _mm512_add_epi32(_mm512_shuffle_i32x4(r03, r47, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_i32x4(r03, r47, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i u = _mm512_shuffle_i32x4(t, t, _MM_SHUFFLE(3, 1, 2, 0));
  return _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
}
inline int32_t hsum_i(__m512i v) { return hsum_i(_mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1))); }
#endif

// A block's decoded state: run(r) its run r's 32 q bytes, scale(r) the int16 scales of run r's byte
// pairs (vpmaddubsw's lanes: 8 a 16 weights), step1() / step8() the float step of one x row / a group.
template <int TYPE>
struct KBlock;

template <int TYPE>  // Q4_K (12), Q5_K (13)
struct K4Block {
  static constexpr int BYTES = TYPE == 12 ? 144 : 176;
  const uint8_t* nib;
  __m256i sc, hb;  // the 8 scales (bytes 0-7) and mins (8-15) in both 128-bit lanes; Q5_K's high bits
  __m128i mn;       // the mins as int16
  float d, nmin;    // d, -dmin
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512i sc4;  // the scales and mins in all four 128-bit lanes
#endif
  explicit K4Block(const uint8_t* p) {
    // k4_scales in vector form: dwords w0, w1, w2 of the 12 bytes -> [sc 0-3, sc 4-7, mn 0-3, mn 4-7]
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
    const __m128i lo = _mm_and_si128(w, _mm_set1_epi8(0x3f));  // [sc 0-3, mn 0-3]
    const __m128i w22 = _mm_srlv_epi32(_mm_shuffle_epi32(w, 0xAA), _mm_setr_epi32(0, 4, 0, 0));
    const __m128i hi = _mm_or_si128(_mm_and_si128(w22, _mm_set1_epi8(15)),
                                    _mm_and_si128(_mm_srli_epi32(w, 2), _mm_set1_epi8(0x30)));  // [sc 4-7, mn 4-7]
    const __m128i all = _mm_unpacklo_epi32(lo, hi);
    sc = _mm256_broadcastsi128_si256(all);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    sc4 = _mm512_broadcast_i32x4(all);
#endif
    mn = _mm_unpackhi_epi8(all, _mm_setzero_si128());
    const __m128 h = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int32_t>(word(p))));  // d, dmin
    d = _mm_cvtss_f32(h), nmin = -_mm_cvtss_f32(_mm_movehdup_ps(h));
    nib = p + (TYPE == 13 ? 48 : 16);
    if constexpr (TYPE == 13) hb = ld32(p + 16);
  }
  __m256i run(int r) const {
    const __m256i v = ld32(nib + 32 * (r / 2)), low = _mm256_set1_epi8(15);
    __m256i q = _mm256_and_si256(r % 2 ? _mm256_srli_epi16(v, 4) : v, low);
    if constexpr (TYPE == 13) {  // bit r of each high byte -> bit 4
      const __m256i h = r < 4 ? _mm256_slli_epi16(hb, 4 - r) : _mm256_srli_epi16(hb, r - 4);
      q = _mm256_or_si256(q, _mm256_and_si256(h, _mm256_set1_epi8(16)));
    }
    return q;
  }
  __m256i scale(int r) const {  // byte r zero-extended into every int16 lane
    const char z = static_cast<char>(0x80), b = static_cast<char>(r);
    return _mm256_shuffle_epi8(sc, _mm256_setr_epi8(b, z, b, z, b, z, b, z, b, z, b, z, b, z, b, z, b, z, b, z, b, z, b,
                                                     z, b, z, b, z, b, z, b, z));
  }
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // runs 2j and 2j + 1 in one register's halves. Q4_K: both are the same 32 bytes (low nibbles, then
  // high), so one broadcast load and a shift of the high half; Q5_K: the two runs, joined
  __m512i run2(int j) const {
    if constexpr (TYPE == 12) {
      const __m512i v = _mm512_broadcast_i64x4(ld32(nib + 32 * j));
      return _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFFFF0000u, v, 4), _mm512_set1_epi8(15));
    } else {
      return join(run(2 * j), run(2 * j + 1));
    }
  }
  __m512i scale2(int j) const {  // byte 2j zero-extended into the low half's int16 lanes, 2j + 1 the high's
    const __m256i lo = _mm256_set1_epi16(static_cast<int16_t>(0x8000 | (2 * j)));
    const __m256i hi = _mm256_set1_epi16(static_cast<int16_t>(0x8000 | (2 * j + 1)));
    return _mm512_shuffle_epi8(sc4, join(lo, hi));
  }
#endif
  // the float step of one x row m (block b's int32 dot), and of a group g of 8 (lane m: row m's dot)
  float step1(int32_t dot, const KX& x, int64_t m, int64_t b, float acc) const {
    const float xd = x.d[m * (x.K / QK) + b];
    const __m128i mins = _mm_madd_epi16(mn, _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.sum32.data() + m * (x.K / 32) + b * 8)));
    acc = fma1(static_cast<float>(dot), d * xd, acc);
    return fma1(static_cast<float>(hsum_i(mins)), nmin * xd, acc);
  }
  __m256 step8(__m256i dots, const KX& x, int64_t g, int64_t b, __m256 facc) const {
    const int64_t gb = g * (x.K / QK) + b;
    const __m256 xd = _mm256_loadu_ps(x.d8.data() + gb * XG);
    const __m256i mins = pairs8(_mm256_castsi128_si256(mn), x.s32p.data() + gb * 64, 4);
    facc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(_mm256_set1_ps(d), xd), facc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(_mm256_set1_ps(nmin), xd), facc);
  }
};
template <>
struct KBlock<12> : K4Block<12> {
  using K4Block<12>::K4Block;
};
template <>
struct KBlock<13> : K4Block<13> {
  using K4Block<13>::K4Block;
};

// The 16 signed scales a 16 of Q6_K (int8) and Q3_K (6-bit, less 32), a block's offset 2^SHIFT times
// each: scale(r) run r's as int16 pairs, step1() / step8() the float step as K4Block's, with dot -
// 2^SHIFT * sc . sum16 (exact).
template <int SHIFT>
struct Signed16 {
  __m256i sc, lo8, hi8;  // the 16 scales as int16; scales 0-7 in both 128-bit lanes; 8-15 in both
  float d;
  Signed16(__m128i s8, float dd) : sc(_mm256_cvtepi8_epi16(s8)), d(dd) {
    lo8 = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sc));
    hi8 = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(sc, 1));
  }
  __m256i scale(int r) const { return pick16(r < 4 ? lo8 : hi8, (2 * r) % 8, (2 * r + 1) % 8); }
  float step1(int32_t dot, const KX& x, int64_t m, int64_t b, float acc) const {
    const __m256i off = _mm256_madd_epi16(sc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sum16.data() + m * (x.K / 16) + b * 16)));
    const float xd = x.d[m * (x.K / QK) + b];
    return fma1(static_cast<float>(dot - (hsum_i(off) << SHIFT)), d * xd, acc);
  }
  __m256 step8(__m256i dots, const KX& x, int64_t g, int64_t b, __m256 facc) const {
    const int64_t gb = g * (x.K / QK) + b;
    const __m256i off = pairs8(sc, x.s16p.data() + gb * 128, 8);
    dots = _mm256_sub_epi32(dots, _mm256_slli_epi32(off, SHIFT));
    const __m256 xd = _mm256_loadu_ps(x.d8.data() + gb * XG);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(_mm256_set1_ps(d), xd), facc);
  }
};

template <>
struct KBlock<14> : Signed16<5> {  // Q6_K
  static constexpr int BYTES = 210;
  const uint8_t* p;
  explicit KBlock(const uint8_t* b)
      : Signed16<5>(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)), half_bits(b + 208)), p(b) {}
  __m256i run(int r) const {  // r = 4h + t: 4 bits from ql, 2 from qh (file header's layout)
    const int h = r / 4, t = r % 4;
    const __m256i lo = ld32(p + 64 * h + 32 * (t % 2)), hi = ld32(p + 128 + 32 * h);
    const __m256i q4 = _mm256_and_si256(t / 2 ? _mm256_srli_epi16(lo, 4) : lo, _mm256_set1_epi8(15));
    const __m256i h2 = t == 0 ? _mm256_slli_epi16(hi, 4) : t == 1 ? _mm256_slli_epi16(hi, 2) : t == 2 ? hi : _mm256_srli_epi16(hi, 2);
    return _mm256_or_si256(q4, _mm256_and_si256(h2, _mm256_set1_epi8(0x30)));
  }
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512i run2(int j) const { return join(run(2 * j), run(2 * j + 1)); }
  __m512i scale2(int j) const { return join(scale(2 * j), scale(2 * j + 1)); }
#endif
};

template <>
struct KBlock<11> : Signed16<2> {  // Q3_K
  static constexpr int BYTES = 110;
  const uint8_t* p;
  explicit KBlock(const uint8_t* b) : Signed16<2>(q3_scales_vec(b + 96), half_bits(b + 108)), p(b) {}
  __m256i run(int r) const {  // r = 4h + j: bits 2j of byte 32 + 32h + l, bit r of byte l the third
    const __m256i lo = _mm256_srl_epi16(ld32(p + 32 + 32 * (r / 4)), _mm_cvtsi32_si128(2 * (r % 4)));
    const __m256i hi = _mm256_srl_epi16(ld32(p), _mm_cvtsi32_si128(r));
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(3)),
                           _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(1)), 2));
  }
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512i run2(int j) const { return join(run(2 * j), run(2 * j + 1)); }
  __m512i scale2(int j) const { return join(scale(2 * j), scale(2 * j + 1)); }
#endif
};

// one weight row . MM x rows (x.q rows xm0 .. xm0 + MM - 1; MM > 1: xm0 a multiple of XG): sums[m]
template <int TYPE, int MM>
inline void krow_dot(const uint8_t* row, const KX& x, int64_t xm0, float* sums) {
  static_assert(MM >= 1 && MM <= XG);
  using B = KBlock<TYPE>;
  const int64_t K = x.K, NB = K / QK;
  const int8_t* xq = x.q.data() + xm0 * K;
  __m256 facc = _mm256_setzero_ps();  // lane m: row m's sum (MM > 1)
  float acc1 = 0.f;                   // MM == 1
  for (int64_t b = 0; b < NB; ++b) {
    const B blk(row + b * B::BYTES);
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // (ACC sums a row: vpdpwssd's accumulator is a chain of 5-cycle steps, and one row's chain through
    // a block's 4 steps, not the bytes, bounded a single request's decode)
    constexpr int ACC = MM <= 2 ? 4 : MM <= 4 ? 2 : 1;
    __m512i acc[MM][ACC];
    for (int m = 0; m < MM; ++m)
      for (int a = 0; a < ACC; ++a) acc[m][a] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {  // runs 2j, 2j + 1 a register
      const __m512i q = blk.run2(j), s = blk.scale2(j);
      for (int m = 0; m < MM; ++m) {
        const __m512i p = _mm512_maddubs_epi16(q, _mm512_loadu_si512(xq + m * K + b * QK + 64 * j));
#if defined(__AVX512VNNI__)
        acc[m][j % ACC] = _mm512_dpwssd_epi32(acc[m][j % ACC], p, s);
#else
        acc[m][j % ACC] = _mm512_add_epi32(acc[m][j % ACC], _mm512_madd_epi16(p, s));
#endif
      }
    }
    __m512i dot[MM];
    for (int m = 0; m < MM; ++m) {
      dot[m] = acc[m][0];
      for (int a = 1; a < ACC; ++a) dot[m] = _mm512_add_epi32(dot[m], acc[m][a]);
    }
#else
    __m256i dot[MM];
    for (int m = 0; m < MM; ++m) dot[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      const __m256i q = blk.run(r), s = blk.scale(r);
      for (int m = 0; m < MM; ++m) {
        const __m256i p = _mm256_maddubs_epi16(q, ld32(xq + m * K + b * QK + 32 * r));
        dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(p, s));
      }
    }
#endif
    if constexpr (MM == 1)
      acc1 = blk.step1(hsum_i(dot[0]), x, xm0, b, acc1);
    else
      facc = blk.step8(rows8<MM>(dot), x, xm0 / XG, b, facc);
  }
  if constexpr (MM == 1) {
    sums[0] = acc1;
  } else {
    alignas(32) float s[XG];
    _mm256_store_ps(s, facc);
    for (int m = 0; m < MM; ++m) sums[m] = s[m];
  }
}
#endif

// one weight row . MM x rows from xm0, by the vector form where there is one
template <int TYPE, int MM>
inline void krow(const uint8_t* row, const KX& x, int64_t xm0, float* sums) {
#if defined(TM_GGUF_KDOT_AVX2)
  krow_dot<TYPE, MM>(row, x, xm0, sums);
#else
  for (int m = 0; m < MM; ++m) sums[m] = krow_dot_scalar<TYPE>(row, x, xm0 + m);
#endif
}

}  // namespace tm_gguf

// GGUF's block formats and the few-row products on them, shared by gguf_blocks.cpp (dequantize, decode
// product) and gguf_gemm.cpp (the prompt product).
//
// Every supported type is written here as one form: a block's weights in runs of 32 bytes q (unsigned,
// Q8_0's signed), a constant offset OFF, and per 16 weights a scale a and (types with a minimum) a
// float b: w = a * (q - OFF) (+ b). a * (q - OFF) is an exact float32 product (a is a float16 times an
// integer of at most 8 bits, q - OFF at most 6 bits wide: under 24 significant bits, signed zeros as
// the reference's), so w rounds at most once, fused or not, exactly as the `gguf` package's dequantizer:
// - Q4_0 (18 bytes: d, 16 nibble bytes): a = d, OFF 8;  Q4_1 (20: d, m, nibbles): a = d, b = m;
// - Q5_0 (22: d, 32 high bits, nibbles): a = d, OFF 16;  Q5_1 (24: d, m, high bits, nibbles): b = m;
// - Q8_0 (34: d, 32 int8): a = d;
//   in those nibble bytes byte j holds weight j (low nibble) and 16 + j (high); bit i of the high bits
//   is weight i's fifth bit;
// - Q4_K (144 bytes a 256: d, dmin, 12 bytes of 6-bit scales and mins for 8 runs of 32, 128 nibble
//   bytes): run 2c is bytes 32c .. 32c + 31's low nibbles, run 2c + 1 their high ones; a = d sc,
//   b = -(dmin m);
// - Q5_K (176: Q4_K's fields, then 32 bytes of high bits before the nibbles): run r's fifth bits are
//   bit r of those 32 bytes;
// - Q6_K (210: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d): weight 128h + 32t + l
//   takes nibble t / 2 of byte 64h + 32(t % 2) + l and bits 2t of byte 128 + 32h + l; per 16 weights
//   a = d sc, OFF 32.
// - Q3_K (110: 32 bytes of high bits, 64 of 2-bit lows, 12 bytes of 6-bit scales, d): run r = 4h + j
//   (weights 32r .. 32r + 31) takes bits 2j of byte 32 + 32h + l and bit r of byte l as its third bit;
//   per 16 weights a = d (sc - 32), OFF 4.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "convert.h"
#include "gguf_kdot.h"

namespace tm_gguf {

constexpr int64_t RUN = 32;      // weights a run (and x values a scale)
constexpr int64_t MAX_ROWS = 8;  // x rows a pass over the weights

// ---- the block formats: W weights, BYTES bytes; params() fills a, b per 16 weights; run() run r's q ----
struct Q4_0 {
  static constexpr int W = 32, BYTES = 18;
  static constexpr bool SIGNED = false, MIN = false;
  static constexpr int OFF = 8;
  static void params(const uint8_t* p, float* a, float* b) { a[0] = a[1] = half_bits(p), b[0] = b[1] = 0.f; }
  static const uint8_t* nibbles(const uint8_t* p) { return p + 2; }
};
struct Q4_1 : Q4_0 {
  static constexpr int BYTES = 20, OFF = 0;
  static constexpr bool MIN = true;
  static void params(const uint8_t* p, float* a, float* b) {
    a[0] = a[1] = half_bits(p), b[0] = b[1] = half_bits(p + 2);
  }
  static const uint8_t* nibbles(const uint8_t* p) { return p + 4; }
};
struct Q5_0 {
  static constexpr int W = 32, BYTES = 22;
  static constexpr bool SIGNED = false, MIN = false;
  static constexpr int OFF = 16;
  static void params(const uint8_t* p, float* a, float* b) { a[0] = a[1] = half_bits(p), b[0] = b[1] = 0.f; }
  static const uint8_t* high(const uint8_t* p) { return p + 2; }
  static const uint8_t* nibbles(const uint8_t* p) { return p + 6; }
};
struct Q5_1 : Q5_0 {
  static constexpr int BYTES = 24, OFF = 0;
  static constexpr bool MIN = true;
  static void params(const uint8_t* p, float* a, float* b) {
    a[0] = a[1] = half_bits(p), b[0] = b[1] = half_bits(p + 2);
  }
  static const uint8_t* high(const uint8_t* p) { return p + 4; }
  static const uint8_t* nibbles(const uint8_t* p) { return p + 8; }
};
struct Q8_0 {
  static constexpr int W = 32, BYTES = 34, OFF = 0;
  static constexpr bool SIGNED = true, MIN = false;
  static void params(const uint8_t* p, float* a, float* b) { a[0] = a[1] = half_bits(p), b[0] = b[1] = 0.f; }
};

struct Q4_K {
  static constexpr int W = 256, BYTES = 144, OFF = 0;
  static constexpr bool SIGNED = false, MIN = true;
  static void params(const uint8_t* p, float* a, float* b) {
    const float d = half_bits(p), dmin = half_bits(p + 2);
    uint64_t sc, mn;
    k4_scales(p + 4, sc, mn);  // (gguf_kdot.h)
    for (int r = 0; r < 8; ++r) {
      a[2 * r] = a[2 * r + 1] = d * static_cast<float>((sc >> (8 * r)) & 255);
      b[2 * r] = b[2 * r + 1] = -(dmin * static_cast<float>((mn >> (8 * r)) & 255));
    }
  }
  static const uint8_t* nibbles(const uint8_t* p) { return p + 16; }
};
struct Q5_K : Q4_K {
  static constexpr int BYTES = 176;
  static const uint8_t* high(const uint8_t* p) { return p + 16; }
  static const uint8_t* nibbles(const uint8_t* p) { return p + 48; }
};
struct Q6_K {
  static constexpr int W = 256, BYTES = 210, OFF = 32;
  static constexpr bool SIGNED = false, MIN = false;
  static void params(const uint8_t* p, float* a, float* b) {
    const float d = half_bits(p + 208);
    for (int g = 0; g < 16; ++g) a[g] = d * static_cast<float>(static_cast<int8_t>(p[192 + g])), b[g] = 0.f;
  }
};

struct Q3_K {
  static constexpr int W = 256, BYTES = 110, OFF = 4;
  static constexpr bool SIGNED = false, MIN = false;
  static void params(const uint8_t* p, float* a, float* b) {
    const float d = half_bits(p + 108);
    int8_t sc[16];
    q3_scales(p + 96, sc);  // (gguf_kdot.h)
    for (int g = 0; g < 16; ++g) a[g] = d * static_cast<float>(sc[g]), b[g] = 0.f;
  }
};

// run r of a block as 32 bytes of q, scalar (the reference the vector forms follow)
template <typename F>
void run_scalar(const uint8_t* p, int r, uint8_t* q) {
  if constexpr (std::is_same_v<F, Q8_0>) {
    std::memcpy(q, p + 2, 32);
  } else if constexpr (std::is_same_v<F, Q4_0> || std::is_same_v<F, Q4_1>) {
    const uint8_t* s = F::nibbles(p);
    for (int j = 0; j < 16; ++j) q[j] = s[j] & 15, q[16 + j] = s[j] >> 4;
  } else if constexpr (std::is_same_v<F, Q5_0> || std::is_same_v<F, Q5_1>) {
    const uint8_t* s = F::nibbles(p);
    const uint32_t h = word(F::high(p));
    for (int j = 0; j < 16; ++j) {
      q[j] = (s[j] & 15) | (((h >> j) & 1) << 4);
      q[16 + j] = (s[j] >> 4) | (((h >> (16 + j)) & 1) << 4);
    }
  } else if constexpr (std::is_same_v<F, Q4_K> || std::is_same_v<F, Q5_K>) {
    const uint8_t* s = F::nibbles(p) + 32 * (r / 2);
    const int shift = 4 * (r % 2);
    for (int l = 0; l < 32; ++l) q[l] = (s[l] >> shift) & 15;
    if constexpr (std::is_same_v<F, Q5_K>)
      for (int l = 0; l < 32; ++l) q[l] |= ((F::high(p)[l] >> r) & 1) << 4;
  } else if constexpr (std::is_same_v<F, Q3_K>) {
    const uint8_t* lo = p + 32 + 32 * (r / 4);
    for (int l = 0; l < 32; ++l) q[l] = ((lo[l] >> (2 * (r % 4))) & 3) | (((p[l] >> r) & 1) << 2);
  } else {  // Q6_K
    const int h = r / 4, t = r % 4;
    const uint8_t* lo = p + 64 * h + 32 * (t % 2);
    const uint8_t* hi = p + 128 + 32 * h;
    for (int l = 0; l < 32; ++l) q[l] = ((lo[l] >> (4 * (t / 2))) & 15) | (((hi[l] >> (2 * t)) & 3) << 4);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#define TM_GGUF_AVX2 1
inline __m256i nibble_pair(const uint8_t* s) {  // 16 bytes -> their low nibbles, then their high ones
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)), low = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}
inline __m256i bits_to_16s(uint32_t h) {  // bit i of h -> byte i: 16 where set, else 0
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(h)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

template <typename F>
inline __m256i run_vec(const uint8_t* p, int r) {
  const __m256i low = _mm256_set1_epi8(15);
  if constexpr (std::is_same_v<F, Q8_0>) {
    return load32(p + 2);
  } else if constexpr (std::is_same_v<F, Q4_0> || std::is_same_v<F, Q4_1>) {
    return nibble_pair(F::nibbles(p));
  } else if constexpr (std::is_same_v<F, Q5_0> || std::is_same_v<F, Q5_1>) {
    return _mm256_or_si256(nibble_pair(F::nibbles(p)), bits_to_16s(word(F::high(p))));
  } else if constexpr (std::is_same_v<F, Q4_K> || std::is_same_v<F, Q5_K>) {
    const __m256i v = load32(F::nibbles(p) + 32 * (r / 2));
    __m256i q = _mm256_and_si256(r % 2 ? _mm256_srli_epi16(v, 4) : v, low);
    if constexpr (std::is_same_v<F, Q5_K>) {
      const __m256i h = _mm256_srl_epi16(load32(F::high(p)), _mm_cvtsi32_si128(r));
      q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(1)), 4));
    }
    return q;
  } else if constexpr (std::is_same_v<F, Q3_K>) {
    const __m256i lo = _mm256_srl_epi16(load32(p + 32 + 32 * (r / 4)), _mm_cvtsi32_si128(2 * (r % 4)));
    const __m256i hi = _mm256_srl_epi16(load32(p), _mm_cvtsi32_si128(r));
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(3)),
                           _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(1)), 2));
  } else {  // Q6_K
    const int h = r / 4, t = r % 4;
    const __m256i lo = _mm256_srl_epi16(load32(p + 64 * h + 32 * (t % 2)), _mm_cvtsi32_si128(4 * (t / 2)));
    const __m256i hi = _mm256_srl_epi16(load32(p + 128 + 32 * h), _mm_cvtsi32_si128(2 * t));
    return _mm256_or_si256(_mm256_and_si256(lo, low),
                           _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(3)), 4));
  }
}
#endif

template <typename F>
inline void run_bytes(const uint8_t* p, int r, uint8_t* q) {
#if defined(TM_GGUF_AVX2)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), run_vec<F>(p, r));
#else
  run_scalar<F>(p, r, q);
#endif
}


// ---- the decode product ----
// x [M, K] -> xq [M, K] int8 (runs of 32, each symmetric with its own scale xs [M, K / 32]) and xs16
// [M, K / 16]: the float sums of the rounded x (xs * the sum of xq) over each 16.
template <typename T>
void quantize_x(const T* x, int64_t x_row, int64_t M, int64_t K, int8_t* xq, float* xs, float* xs16) {
  float v[RUN];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < K / RUN; ++r) {
      to_float(x + m * x_row + r * RUN, v, RUN);
      float amax = 0.f;
      for (int i = 0; i < RUN; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f, s = amax / 127.f;
      int8_t* q = xq + m * K + r * RUN;
      int32_t lo = 0, hi = 0;
      for (int i = 0; i < RUN; ++i) q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
      for (int i = 0; i < 16; ++i) lo += q[i], hi += q[16 + i];
      xs[m * (K / RUN) + r] = s;
      xs16[m * (K / 16) + 2 * r] = s * static_cast<float>(lo);
      xs16[m * (K / 16) + 2 * r + 1] = s * static_cast<float>(hi);
    }
}

struct XRows {
  const int8_t* xq;   // [MM, K]
  const float* xs;    // [MM, K / 32]
  const float* xs16;  // [MM, K / 16]
  int64_t K;
};

// One weight row against MM x rows: sums[m] = row . x'[m] (the 32-weight types; K-quants: gguf_kdot.h).
// AVX2: a block's q . xq in integers (offset types shifted to signed, q - OFF, and multiplied through
// vpsignb's trick: |q| unsigned times xq carrying q's sign), one float step a block and row; the
// minimum types' b term from x's float sums.
template <typename F, int MM>
inline void row_dot(const uint8_t* row, const XRows& x, float (&sums)[MM]) {
  static_assert(F::W == RUN, "row_dot: 32-weight blocks");
  const int64_t K = x.K, R = K / RUN, G = K / 16;
  float off[MM];
  for (int m = 0; m < MM; ++m) off[m] = 0.f;
#if defined(TM_GGUF_AVX2)
  constexpr bool SIGNED = F::SIGNED || !F::MIN;  // q (Q8_0) or q - OFF (Q4_0, Q5_0) signed
  __m256 acc[MM];
  for (int m = 0; m < MM; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t blk = 0; blk < R; ++blk) {
    const uint8_t* p = row + blk * F::BYTES;
    const float d = half_bits(p);
    __m256i q = run_vec<F>(p, 0);
    if constexpr (!F::SIGNED && !F::MIN) q = _mm256_sub_epi8(q, _mm256_set1_epi8(F::OFF));
    const __m256i qa = SIGNED ? _mm256_sign_epi8(q, q) : q;
    for (int m = 0; m < MM; ++m) {
      __m256i xv = load32(reinterpret_cast<const uint8_t*>(x.xq + m * K + blk * RUN));
      if constexpr (SIGNED) xv = _mm256_sign_epi8(xv, q);
      // (pairs of |q| x: |q| <= 31, or 128 for Q8_0, |x| <= 127: within int16)
      const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(qa, xv), ones);
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * x.xs[m * R + blk]), acc[m]);
    }
    if constexpr (F::MIN) {
      const float b = half_bits(p + 2);
      for (int m = 0; m < MM; ++m) off[m] += b * (x.xs16[m * G + 2 * blk] + x.xs16[m * G + 2 * blk + 1]);
    }
  }
  for (int m = 0; m < MM; ++m) sums[m] = hsum8(acc[m]) + off[m];
#else
  float a[16], b[16], acc[MM];
  for (int m = 0; m < MM; ++m) acc[m] = 0.f;
  for (int64_t blk = 0; blk < R; ++blk) {
    const uint8_t* p = row + blk * F::BYTES;
    F::params(p, a, b);
    alignas(32) uint8_t q[RUN];
    run_scalar<F>(p, 0, q);
    for (int m = 0; m < MM; ++m) {
      const int8_t* xv = x.xq + m * K + blk * RUN;
      int32_t lo = 0, hi = 0;
      for (int i = 0; i < 16; ++i) {
        lo += (F::SIGNED ? static_cast<int8_t>(q[i]) : q[i]) * xv[i];
        hi += (F::SIGNED ? static_cast<int8_t>(q[16 + i]) : q[16 + i]) * xv[16 + i];
      }
      acc[m] += x.xs[m * R + blk] * (a[0] * static_cast<float>(lo) + a[1] * static_cast<float>(hi));
      const float* xg = x.xs16 + m * G + 2 * blk;
      if (!F::SIGNED)  // (Q8_0's b are 0)
        off[m] += (b[0] - static_cast<float>(F::OFF) * a[0]) * xg[0] + (b[1] - static_cast<float>(F::OFF) * a[1]) * xg[1];
    }
  }
  for (int m = 0; m < MM; ++m) sums[m] = acc[m] + off[m];
#endif
}
// a row of W (K weights) in float32 or rounded to bfloat16, each weight a * q (+ b) in float32 as the
// `gguf` package's dequantizer computes it
template <typename F, typename T>
inline void dequant_row(const uint8_t* row, int64_t K, T* out) {
  alignas(32) uint8_t q[RUN];
  float a[16], b[16], w[RUN];
  for (int64_t blk = 0; blk < K / F::W; ++blk) {
    const uint8_t* p = row + blk * F::BYTES;
    F::params(p, a, b);
    for (int r = 0; r < F::W / RUN; ++r) {
      run_bytes<F>(p, r, q);
      for (int i = 0; i < RUN; ++i) {
        const int qi = F::SIGNED ? static_cast<int8_t>(q[i]) : q[i] - F::OFF;
        const float aq = a[2 * r + i / 16] * static_cast<float>(qi);  // exact
        w[i] = F::MIN ? aq + b[2 * r + i / 16] : aq;
      }
      from_float_row(w, out + blk * F::W + r * RUN, RUN);
    }
  }
}

// a K-quant format's GGML type number (gguf_kdot.h's KBlock)
template <typename F>
constexpr int k_type() {
  return std::is_same_v<F, Q3_K> ? 11 : std::is_same_v<F, Q4_K> ? 12 : std::is_same_v<F, Q5_K> ? 13 : 14;
}

template <typename Fn>
void with_format(int64_t type, Fn&& f) {
  switch (type) {
    case 2: f.template operator()<Q4_0>(); break;
    case 3: f.template operator()<Q4_1>(); break;
    case 6: f.template operator()<Q5_0>(); break;
    case 7: f.template operator()<Q5_1>(); break;
    case 8: f.template operator()<Q8_0>(); break;
    case 11: f.template operator()<Q3_K>(); break;
    case 12: f.template operator()<Q4_K>(); break;
    case 13: f.template operator()<Q5_K>(); break;
    case 14: f.template operator()<Q6_K>(); break;
    default: TORCH_CHECK(false, "gguf: unsupported GGML type ", type);
  }
}

inline void check_blocks(const char* op, const at::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1 && w.stride(0) == w.size(1),
              op, ": blocks must be contiguous uint8 [N, row bytes]");
  with_format(type, [&]<typename F>() {
    TORCH_CHECK(K % F::W == 0 && w.size(1) == K / F::W * F::BYTES, op, ": ", w.size(1),
                " bytes a row do not hold ", K, " weights of GGML type ", type);
  });
}


}  // namespace tm_gguf

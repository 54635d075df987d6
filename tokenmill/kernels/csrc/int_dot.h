// Integer dot products for the quantized linear kernels (linear_int8.cpp, linear_int4.cpp): x rows held
// as int16 with one float scale a row, and the vector ops on int16 pairs each instruction set has.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "convert.h"

namespace tm_int {

// ---- x in 16-bit fixed point ----
// x rows are held as int16 with one float scale a row (x[m, k] ~ x16[m, k] * xs[m], |x16| <= 32767:
// an error under 2^-16 of the row's largest value, far under the weights' own 8- or 4-bit rounding),
// so products are integer pairs (vpdpwssd: 32 multiply-adds an instruction) where widening int8
// weights to float32 took three instructions per 16 (measured faster this way on the peer model's int8
// products at one row). Sums are exact in int32 over chunks of at most CHUNK
// k (|sum| <= 256 * 127 * 32767 < 2^31), then scaled into float32.
constexpr int64_t CHUNK = 256;
#ifndef TM_I8_HINT
#define TM_I8_HINT _MM_HINT_T1
#endif
#ifndef TM_I8_PREFETCH
#define TM_I8_PREFETCH 12288  // bytes of weights ahead (L2): 8-16 KB measured alike, 2-4 KB slower
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct I16 {
  using V = __m512i;  // 16 int32 sums
  using F = __m512;
  static constexpr int W = 32;  // k per step
  static V zero() { return _mm512_setzero_si512(); }
  static V load_w(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load_x(const int16_t* p) { return _mm512_loadu_si512(p); }
#if defined(__AVX512VNNI__)
  static V dot(V acc, V w, V x) { return _mm512_dpwssd_epi32(acc, w, x); }
#else
  static V dot(V acc, V w, V x) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x)); }
#endif
  static V add(V a, V b) { return _mm512_add_epi32(a, b); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F scaled(V acc, float s, F into) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(s), into); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct I16 {
  using V = __m256i;  // 8 int32 sums
  using F = __m256;
  static constexpr int W = 16;
  static V zero() { return _mm256_setzero_si256(); }
  static V load_w(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V load_x(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static V dot(V acc, V w, V x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }
  static V add(V a, V b) { return _mm256_add_epi32(a, b); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F scaled(V acc, float s, F into) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(s), into); }
  static float sum(F v) { return hsum8(v); }
};
#else
struct I16 {
  using V = int32_t;
  using F = float;
  static constexpr int W = 1;
  static V zero() { return 0; }
  static V load_w(const int8_t* p) { return *p; }
  static V load_x(const int16_t* p) { return *p; }
  static V dot(V acc, V w, V x) { return acc + w * x; }
  static V add(V a, V b) { return a + b; }
  static F fzero() { return 0.f; }
  static F scaled(V acc, float s, F into) { return static_cast<float>(acc) * s + into; }
  static float sum(F v) { return v; }
};
#endif

// Independent sums a row keeps so that chains of dependent instructions do not bound it (one x row:
// four, two rows: two; more rows are independent chains themselves; at one row 2, 4 and 8 measured alike).
template <int MM>
constexpr int chains() {
  return MM == 1 ? 4 : MM == 2 ? 2 : 1;
}

// f.template operator()<MM>() for the run-time row count mm in [1, MAXM] (the kernels' loops are
// compiled per count, so their accumulators stay in registers).
template <int MAXM, typename F>
inline void with_rows(int64_t mm, F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    (void)((mm == I + 1 ? (f.template operator()<I + 1>(), true) : false) || ...);
  }(std::make_integer_sequence<int, MAXM>{});
}

// x [M, K] (row stride x_row) -> q [M, K], xs [M]: each row symmetric with its own scale, |q| <= QMAX,
// x[m] ~ q[m] * xs[m] (a row of zeros: scale 0); Q int16 (QMAX 32767: the weight-only kernels' 16-bit
// fixed point) or int8 (127: W8A8's activations).
template <typename Q, int QMAX, typename T>
void quantize_rows_to(const T* x, int64_t x_row, int64_t M, int64_t K, Q* q, float* xs) {
  std::vector<float> row(K);
  for (int64_t m = 0; m < M; ++m) {
    to_float(x + m * x_row, row.data(), K);
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
    const float inv = amax > 0.f ? static_cast<float>(QMAX) / amax : 0.f;
    for (int64_t k = 0; k < K; ++k) q[m * K + k] = static_cast<Q>(std::nearbyint(row[k] * inv));
    xs[m] = amax / static_cast<float>(QMAX);
  }
}

template <typename T>
void to_int16_rows(const T* x, int64_t x_row, int64_t M, int64_t K, int16_t* x16, float* xs) {
  quantize_rows_to<int16_t, 32767>(x, x_row, M, K, x16, xs);
}

}  // namespace tm_int

// float32 <-> storage dtype for the CPU kernels: bfloat16 widened by a shift (vectorizes), float32 copied;
// and the sum of an AVX2 vector's 8 lanes, which the kernels share.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <bit>
#include <cstdint>
#include <cstring>

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  // (floats written as floats: writing them through a uint32_t pointer breaks strict aliasing, and a
  // local array read right after came back unwritten)
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(bits[i]) << 16);
}

// Rounds to the storage dtype (bfloat16: round to nearest even, NaN kept a quiet NaN, as torch does;
// written with bit operations so loops over it vectorize).
template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint16_t bits = static_cast<uint16_t>(x != x ? 0x7FC0u : rounded);
  return c10::BFloat16(bits, c10::BFloat16::from_bits());
}

// dst[0:n] = src[0:n] rounded to the storage dtype.
inline void from_float_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void from_float_row(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = std::bit_cast<uint32_t>(src[i]);
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    out[i] = static_cast<uint16_t>(nan ? 0x7FC0u : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}

// A float32 value as the storage dtype holds it (rounded and widened back).
template <typename T>
inline float round_trip(float x) {
  return x;
}

template <>
inline float round_trip<c10::BFloat16>(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint32_t rounded = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16;
  return std::bit_cast<float>(x != x ? 0x7FC00000u : rounded);
}

// sigmoid(x) = 1 / (1 + exp(-x)) through exp of a non-positive argument only (vectorizable).
__attribute__((always_inline)) inline float exp_nonpositive(float x);
inline float sigmoid(float x) {
  const float e = exp_nonpositive(-std::fabs(x));  // exp(-|x|)
  const float d = 1.f / (1.f + e);                 // one division, then a select: no branch in the loop
  return x < 0.f ? e * d : d;
}

// exp(x) for x <= 0 (softmax terms after subtracting the running max), vectorizable: x = n ln2 + r,
// exp(r) by a degree-6 polynomial on |r| <= ln2 / 2 (Cephes' coefficients, ~1 ulp), 2^n from the
// exponent bits. Below -87.3 (and for -inf) it returns ~1e-38 instead of underflowing to 0.
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  const float t = x * 1.44269504088896341f + 0.5f;
  int32_t k = static_cast<int32_t>(t);  // truncates toward zero; floor(t) is one less below zero
  k -= static_cast<int32_t>(static_cast<float>(k) > t);
  const float n = static_cast<float>(k);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = (k + 127) << 23;
  return y * std::bit_cast<float>(bits);
}

#if defined(__AVX2__)
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

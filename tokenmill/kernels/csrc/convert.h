// float32 <-> storage dtype for the CPU kernels: bfloat16 widened by a shift (vectorizes), float32 copied.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// Rounds to the storage dtype (bfloat16: round to nearest even, as torch does).
template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

// exp(x) for x <= 0 (softmax terms after subtracting the running max), vectorizable: x = n ln2 + r,
// exp(r) by a degree-6 polynomial on |r| <= ln2 / 2 (Cephes' coefficients, ~1 ulp), 2^n from the
// exponent bits. Below -87.3 (and for -inf) it returns ~1e-38 instead of underflowing to 0.
inline float exp_nonpositive(float x) {
  x = x < -87.3f ? -87.3f : x;
  const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

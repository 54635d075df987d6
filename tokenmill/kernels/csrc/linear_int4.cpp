// Linear layers with int4 weights on the CPU, for decode batches (few x rows): y [M, N] = x [M, K] @
// W^T (+ bias), W in asymmetric groups: W[n, k] = q[n, k] * scales[n, g] + mins[n, g], g = k / group,
// q in 0..15.
//
// Layout (`packed` [N, K / 2] uint8, tokenmill's own): each row in blocks of 64 k, byte j (0..31) of a
// block holding k = j in its low nibble and k = 32 + j in its high one, so one 32-byte load gives two
// runs of 32 consecutive k; a last block of 32 k (K % 64 == 32) holds k = j and 16 + j in its 16 bytes.
// x rows in 16-bit fixed point (int_dot.h): a group's sum is s * sum(q * x16) + m * sum(x16), the first
// integer (vpdpwssd on the nibbles widened to int16), the second from per-group sums of x16 made
// once per call. One weight row at a time against up to 8 x rows, each thread a contiguous range of
// rows; group a power of two from 32 dividing K.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <vector>

#include "convert.h"
#include "int_dot.h"
#include "linear_amx.h"

namespace {

using namespace tm_int;
using bf16 = c10::BFloat16;
constexpr int64_t MAX_ROWS = 8;

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 32 bytes of a 64-k block -> its two runs of 32 k as int16 (low nibbles, then high)
inline void unpack64(const uint8_t* p, __m512i& lo, __m512i& hi) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  lo = _mm512_cvtepu8_epi16(_mm256_and_si256(b, mask));
  hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(b, 4), mask));
}
// 16 bytes of a 32-k block -> its 32 k as int16
inline __m512i unpack32(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m256i both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
  return _mm512_cvtepu8_epi16(both);
}
#endif

// The value of k in a row's packed bytes.
inline int32_t nibble(const uint8_t* row, int64_t K, int64_t k) {
  const int64_t block = k / 64, in = k % 64;
  if (block * 64 + 64 <= K) return (row[block * 32 + in % 32] >> (in < 32 ? 0 : 4)) & 15;
  return (row[block * 32 + in % 16] >> (in < 16 ? 0 : 4)) & 15;  // the last block of 32
}

// sums[m] = sum over g of scales[g] * sum(q * x16[m]) + mins[g] * xg[m][g] (times xs[m] later) for one
// weight row (its packed bytes, scales, mins), MM x rows (x16 row stride K; xg [MM, G] float).
template <int MM>
inline void int4_row(const uint8_t* p, const float* scales, const float* mins, int shift, int64_t K,
                     const int16_t* x, const float* xg, int64_t G, float* sums) {
  float bias_part[MM] = {};
  for (int64_t g = 0; g < G; ++g)
    for (int m = 0; m < MM; ++m) bias_part[m] += mins[g] * xg[m * G + g];
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 tot[MM][2];
  for (int m = 0; m < MM; ++m) tot[m][0] = tot[m][1] = _mm512_setzero_ps();
  const int64_t full = K / 64 * 64;
  if (shift == 5) {  // groups of 32: each run of a block is a group
    for (int64_t k = 0; k < full; k += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p + k / 2 + TM_I8_PREFETCH), TM_I8_HINT);
      __m512i lo, hi;
      unpack64(p + k / 2, lo, hi);
      const __m512 s_lo = _mm512_set1_ps(scales[k >> 5]), s_hi = _mm512_set1_ps(scales[(k >> 5) + 1]);
      for (int m = 0; m < MM; ++m) {
        const __m512i a = I16::dot(I16::zero(), lo, I16::load_x(x + m * K + k));
        const __m512i b = I16::dot(I16::zero(), hi, I16::load_x(x + m * K + k + 32));
        tot[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), s_lo, tot[m][0]);
        tot[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), s_hi, tot[m][1]);
      }
    }
  } else {  // groups of 64 and more: whole blocks, summed in int32 until the group ends
    const int64_t group = int64_t{1} << shift;
    for (int64_t g0 = 0; g0 < full; g0 += group) {
      __m512i acc[MM][2];
      for (int m = 0; m < MM; ++m) acc[m][0] = acc[m][1] = I16::zero();
      for (int64_t k = g0; k < std::min(full, g0 + group); k += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(p + k / 2 + TM_I8_PREFETCH), TM_I8_HINT);
        __m512i lo, hi;
        unpack64(p + k / 2, lo, hi);
        for (int m = 0; m < MM; ++m) {
          acc[m][0] = I16::dot(acc[m][0], lo, I16::load_x(x + m * K + k));
          acc[m][1] = I16::dot(acc[m][1], hi, I16::load_x(x + m * K + k + 32));
        }
      }
      const __m512 s = _mm512_set1_ps(scales[g0 >> shift]);
      for (int m = 0; m < MM; ++m) {
        tot[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][0]), s, tot[m][0]);
        tot[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m][1]), s, tot[m][1]);
      }
    }
  }
  if (full < K) {  // the last block of 32 (a group of its own only when group == 32)
    const __m512i w = unpack32(p + full / 2);
    const __m512 s = _mm512_set1_ps(scales[full >> shift]);
    for (int m = 0; m < MM; ++m)
      tot[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I16::dot(I16::zero(), w, I16::load_x(x + m * K + full))), s,
                                  tot[m][0]);
  }
  for (int m = 0; m < MM; ++m) sums[m] = _mm512_reduce_add_ps(_mm512_add_ps(tot[m][0], tot[m][1])) + bias_part[m];
#else
  // other instruction sets: scalar, one group at a time
  const int64_t group = int64_t{1} << shift;
  for (int m = 0; m < MM; ++m) sums[m] = bias_part[m];
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    int64_t dot[MM] = {};
    for (int64_t k = g0; k < g0 + group; ++k) {
      const int32_t q = nibble(p, K, k);
      for (int m = 0; m < MM; ++m) dot[m] += q * x[m * K + k];
    }
    for (int m = 0; m < MM; ++m) sums[m] += scales[g0 >> shift] * static_cast<float>(dot[m]);
  }
#endif
}

template <typename T>
void int4_impl(at::Tensor& out, const T* x, int64_t x_row, int64_t M, const at::Tensor& packed,
               const at::Tensor& scales, const at::Tensor& mins, int64_t group, const T* bias) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2, G = K / group;
  std::vector<int16_t> x16(M * K);
  std::vector<float> xs(M), xg(M * G);  // xg: each group's sum of x16, per x row
  to_int16_rows(x, x_row, M, K, x16.data(), xs.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      int64_t sum = 0;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += x16[m * K + k];
      xg[m * G + g] = static_cast<float>(sum);
    }
  const int shift = std::countr_zero(static_cast<uint64_t>(group));
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* mp = mins.data_ptr<float>();
  T* y = out.data_ptr<T>();
  const int64_t y_row = out.stride(0);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / K);  // ~128 KB of weights a thread at least
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float sums[MAX_ROWS];
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
      const int64_t mm = std::min(MAX_ROWS, M - m0);
      const int16_t* xm = x16.data() + m0 * K;
      const float* xgm = xg.data() + m0 * G;
      for (int64_t n = begin; n < end; ++n) {
        const uint8_t* pn = pp + n * (K / 2);
        const float *sn = sp + n * G, *mn = mp + n * G;
        with_rows<8>(mm, [&]<int MM>() { int4_row<MM>(pn, sn, mn, shift, K, xm, xgm, G, sums); });
        const float b = bias ? static_cast<float>(bias[n]) : 0.f;
        for (int64_t m = 0; m < mm; ++m) y[(m0 + m) * y_row + n] = from_float<T>(sums[m] * xs[m0 + m] + b);
      }
    }
  });
}

}  // namespace

namespace tokenmill {

// out [M, N] = x [M, K] @ W^T (+ bias), W as packed [N, K / 2] (uint8, the layout above), scales and mins
// [N, K / group] (float32).
void linear_int4(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                 const at::Tensor& mins, int64_t group, const c10::optional<at::Tensor>& bias, bool amx) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_int4: x must be [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.size(1) * 2 == K && K % 32 == 0,
              "linear_int4: packed must be contiguous uint8 [N, K / 2] for x [M, K], K a multiple of 32");
  // (a group's int32 sum stays under 4096 * 15 * 32767 < 2^31)
  TORCH_CHECK(group >= 32 && group <= 4096 && (group & (group - 1)) == 0 && K % group == 0,
              "linear_int4: group must be a power of two from 32 to 4096 dividing K, got ", group);
  const int64_t N = packed.size(0);
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->dim() == 2 && t->is_contiguous() && t->scalar_type() == at::kFloat && t->size(0) == N &&
                    t->size(1) == K / group,
                "linear_int4: scales and mins must be contiguous float32 [N, K / group]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == M && out.size(1) == N,
              "linear_int4: out must be [M, N] with contiguous rows");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  out.scalar_type() == x.scalar_type(),
              "linear_int4: x and out float32 or bfloat16, one dtype");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                                     bias->numel() == N),
              "linear_int4: bias must be contiguous [N] in x's dtype");
  if (M == 0 || N == 0) return;
  if (amx) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_int4: the AMX mode takes bfloat16 x");
    int64_t done = 0;
#if defined(TM_AMX)
    // the weights dequantized 32 k of a row at a time (q * scale + min: one group a step) into bfloat16 tiles
    const uint8_t* pp = packed.data_ptr<uint8_t>();
    const float* sp = scales.data_ptr<float>();
    const float* mp = mins.data_ptr<float>();
    const int64_t G = K / group, full = K / 64 * 64;
    const int shift = std::countr_zero(static_cast<uint64_t>(group));
    bf16* y = out.data_ptr<bf16>();
    const bf16* b = bias ? bias->data_ptr<bf16>() : nullptr;
    const int64_t y_row = out.stride(0);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const auto rows = [&](int64_t n, int64_t k) {
      const uint8_t* row = pp + n * (K / 2);
      __m128i lo, hi;  // the 32 values, k 0-15 and 16-31
      if (k < full) {  // a run of a 64-k block: low nibbles for its first 32 k, high for the last
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k / 64 * 32));
        const __m256i v = k % 64 == 0 ? _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F))
                                      : _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0F));
        lo = _mm256_castsi256_si128(v);
        hi = _mm256_extracti128_si256(v, 1);
      } else {  // the last block of 32
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + full / 2));
        lo = _mm_and_si128(bytes, mask);
        hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
      }
      const __m512 s = _mm512_set1_ps(sp[n * G + (k >> shift)]), m = _mm512_set1_ps(mp[n * G + (k >> shift)]);
      const __m512 flo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), s, m);
      const __m512 fhi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), s, m);
      return tm_amx::to_bf16x32(flo, fhi);
    };
    done = tm_amx::linear_rows_bf16(x.data_ptr<bf16>(), x.stride(0), M, N, K, rows, [&](int64_t mi, int64_t n, float sum) {
      y[mi * y_row + n] = from_float<bf16>(sum + (b ? static_cast<float>(b[n]) : 0.f));
    });
#endif
    if (done < N) {  // the rows short of a block (or no tiles): one weight row at a time
      const c10::optional<at::Tensor> rest_bias = bias ? c10::optional<at::Tensor>(bias->narrow(0, done, N - done)) : bias;
      linear_int4(out.narrow(1, done, N - done), x, packed.narrow(0, done, N - done), scales.narrow(0, done, N - done),
                  mins.narrow(0, done, N - done), group, rest_bias, false);
    }
    return;
  }
  if (x.scalar_type() == at::kFloat)
    int4_impl<float>(out, x.data_ptr<float>(), x.stride(0), M, packed, scales, mins, group,
                     bias ? bias->data_ptr<float>() : nullptr);
  else
    int4_impl<bf16>(out, x.data_ptr<bf16>(), x.stride(0), M, packed, scales, mins, group,
                    bias ? bias->data_ptr<bf16>() : nullptr);
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def(
      "linear_int4(Tensor(a!) out, Tensor x, Tensor packed, Tensor scales, Tensor mins, int group, Tensor? bias, "
      "bool amx) -> ()");
  m.impl("linear_int4", c10::DispatchKey::CPU, &tokenmill::linear_int4);
}

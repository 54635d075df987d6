// int8 weights against many x rows (prompt chunks) with int8 activations, on AVX-512 VNNI:
// y [M, N] = x [M, K] @ W^T (+ bias), W[n, k] = q[n, k] * scales[n] (per output channel, the int8
// method's default grid; q row-major as the decode kernels read it, nothing repacked).
//
// x is rounded to int8 in runs of RUN k with a float scale each (as llama.cpp rounds activations for
// its K-quant products, Q8_K's 256), so a product is integer: vpdpbusd multiplies 64 bytes of x by 64
// of a weight row (64 multiply-adds an instruction, twice the 16-bit fixed point's vpdpwssd that the
// weight-only decode kernels use), x held as xq + 128 in unsigned bytes and 128 * sum(q over the run)
// taken off. A run's int32 lanes are scaled into float32 lanes by its x scale; the lanes are summed
// once, at the end of K.
//
// A tile is TR weight rows x up to MX x rows, all in registers over K (TR x MX int32 and float32
// accumulators). Threads take ranges of weight tiles; each thread walks blocks of X_BLOCK x rows
// (which stay in L2) over its tiles in turn, each tile's rows in L1 across the block.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "convert.h"
#include "int_dot.h"

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t RUN = 256;     // k per x scale
constexpr int64_t STEP = 64;     // k per vpdpbusd
constexpr int TR = 4;            // weight rows a tile
constexpr int MX = 3;            // x rows a tile
constexpr int64_t X_BLOCK = 96;  // x rows a thread walks its tiles with

// x rows [m0, m1) -> xu (xq + 128 as unsigned bytes, |xq| <= 127) [M, K], xs [M, R]: each run of RUN
// k (the last one K - (R - 1) * RUN) symmetric with its own scale
template <typename T>
void quantize_runs(const T* x, int64_t x_row, int64_t m0, int64_t m1, int64_t K, uint8_t* xu, float* xs) {
  const int64_t R = (K + RUN - 1) / RUN;
  float v[RUN];
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t len = std::min(RUN, K - r * RUN);
      to_float(x + m * x_row + r * RUN, v, len);
      float amax = 0.f;
      for (int64_t k = 0; k < len; ++k) amax = std::max(amax, std::fabs(v[k]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      uint8_t* u = xu + m * K + r * RUN;
      for (int64_t k = 0; k < len; ++k) u[k] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(v[k] * inv)) + 128);
      xs[m * R + r] = amax / 127.f;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TM_INT8_GEMM 1

// base[r * TR + t]: -128 * (weight row t's q over run r), in int32 lanes (each lane 4 k): the start of
// a run's sums, so that x's +128 leaves nothing behind
inline void run_offsets(const int8_t* const (&w)[TR], int64_t K, __m512i* base) {
  const __m512i ones = _mm512_set1_epi8(1);
  const int64_t R = (K + RUN - 1) / RUN;
  for (int64_t r = 0; r < R; ++r)
    for (int t = 0; t < TR; ++t) {
      __m512i s = _mm512_setzero_si512();
      for (int64_t k = r * RUN; k < std::min(K, (r + 1) * RUN); k += STEP)
        s = _mm512_dpbusd_epi32(s, ones, _mm512_loadu_si512(w[t] + k));
      base[r * TR + t] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s, 7));
    }
}

// out[t][m] = sum over k of q[t, k] * x[m, k] (x as its int8 runs times their scales), MM x rows
template <int MM>
__attribute__((always_inline)) inline void gemm_tile(const int8_t* const (&w)[TR], int64_t K, const uint8_t* xu,
                                                     const float* xs, const __m512i* base, float (&out)[TR][MX]) {
  const int64_t R = (K + RUN - 1) / RUN;
  __m512 acc[TR][MM];
  for (int t = 0; t < TR; ++t)
    for (int m = 0; m < MM; ++m) acc[t][m] = _mm512_setzero_ps();
  for (int64_t r = 0; r < R; ++r) {
    __m512i dot[TR][MM];
    for (int t = 0; t < TR; ++t)
      for (int m = 0; m < MM; ++m) dot[t][m] = base[r * TR + t];
    for (int64_t k = r * RUN; k < std::min(K, (r + 1) * RUN); k += STEP) {
      __m512i wv[TR];
      for (int t = 0; t < TR; ++t) wv[t] = _mm512_loadu_si512(w[t] + k);
      for (int m = 0; m < MM; ++m) {
        const __m512i xv = _mm512_loadu_si512(xu + m * K + k);
        for (int t = 0; t < TR; ++t) dot[t][m] = _mm512_dpbusd_epi32(dot[t][m], xv, wv[t]);
      }
    }
    for (int m = 0; m < MM; ++m) {
      const __m512 s = _mm512_set1_ps(xs[m * R + r]);
      for (int t = 0; t < TR; ++t) acc[t][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t][m]), s, acc[t][m]);
    }
  }
  for (int t = 0; t < TR; ++t)
    for (int m = 0; m < MM; ++m) out[t][m] = _mm512_reduce_add_ps(acc[t][m]);
}

template <typename T>
void gemm_impl(at::Tensor& out, const T* x, int64_t x_row, int64_t M, const int8_t* q, int64_t N, int64_t K,
               const float* scales, const T* bias) {
  const int64_t R = (K + RUN - 1) / RUN, tiles = (N + TR - 1) / TR;
  std::vector<uint8_t> xu(M * K);
  std::vector<float> xs(M * R);
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    quantize_runs(x, x_row, begin, end, K, xu.data(), xs.data());
  });
  T* y = out.data_ptr<T>();
  const int64_t y_row = out.stride(0);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> base(R * TR);
    float sums[TR][MX];
    for (int64_t b0 = 0; b0 < M; b0 += X_BLOCK) {
      const int64_t b1 = std::min(M, b0 + X_BLOCK);
      for (int64_t tile = begin; tile < end; ++tile) {
        const int64_t n0 = tile * TR, nt = std::min<int64_t>(TR, N - n0);
        const int8_t* w[TR];
        for (int t = 0; t < TR; ++t) w[t] = q + std::min(n0 + t, N - 1) * K;  // (past N: row N - 1, unused)
        run_offsets(w, K, base.data());
        for (int64_t m0 = b0; m0 < b1; m0 += MX) {
          const int64_t mm = std::min<int64_t>(MX, b1 - m0);
          tm_int::with_rows<MX>(mm, [&]<int MM>() {
            gemm_tile<MM>(w, K, xu.data() + m0 * K, xs.data() + m0 * R, base.data(), sums);
          });
          for (int t = 0; t < nt; ++t) {
            const float s = scales[n0 + t], b = bias ? static_cast<float>(bias[n0 + t]) : 0.f;
            for (int64_t m = 0; m < mm; ++m) y[(m0 + m) * y_row + n0 + t] = from_float<T>(sums[t][m] * s + b);
          }
        }
      }
    }
  });
}
#endif

}  // namespace

namespace tokenmill {

// out [M, N] = x [M, K] @ (q * scales)^T (+ bias): q int8 [N, K], scales float32 [N] (per output
// channel), x float32 or bfloat16 rounded to int8 in runs of 256 k; K a multiple of 64. AVX-512 VNNI
// builds alone (`int8_gemm_built`).
void linear_int8_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_int8_gemm: x must be [M, K] with contiguous rows");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar, "linear_int8_gemm: q must be contiguous int8 [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && K % STEP == 0, "linear_int8_gemm: q must be [N, K] with K a multiple of 64");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == N,
              "linear_int8_gemm: scales must be contiguous float32, one per output row");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == M && out.size(1) == N &&
                  out.scalar_type() == x.scalar_type(),
              "linear_int8_gemm: out must be [M, N] with contiguous rows, x's dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "linear_int8_gemm: x float32 or bfloat16");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == x.scalar_type()),
              "linear_int8_gemm: bias must be contiguous [N] in x's dtype");
  if (M == 0 || N == 0) return;
#if defined(TM_INT8_GEMM)
  if (x.scalar_type() == at::kFloat)
    gemm_impl<float>(out, x.data_ptr<float>(), x.stride(0), M, q.data_ptr<int8_t>(), N, K, scales.data_ptr<float>(),
                     bias ? bias->data_ptr<float>() : nullptr);
  else
    gemm_impl<bf16>(out, x.data_ptr<bf16>(), x.stride(0), M, q.data_ptr<int8_t>(), N, K, scales.data_ptr<float>(),
                    bias ? bias->data_ptr<bf16>() : nullptr);
#else
  TORCH_CHECK(false, "linear_int8_gemm: built for AVX-512 VNNI only (int8_gemm_built() is false here)");
#endif
}

bool int8_gemm_built() {
#if defined(TM_INT8_GEMM)
  return true;
#else
  return false;
#endif
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("linear_int8_gemm(Tensor(a!) out, Tensor x, Tensor q, Tensor scales, Tensor? bias) -> ()");
  m.impl("linear_int8_gemm", c10::DispatchKey::CPU, &tokenmill::linear_int8_gemm);
  m.def("int8_gemm_built() -> bool", &tokenmill::int8_gemm_built);
}

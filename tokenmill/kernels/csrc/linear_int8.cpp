// Linear layers with int8 weights on the CPU, for decode batches (few x rows): y [M, N] = x [M, K] @
// W^T (+ bias), W stored as int8 q [N, K] with float32 scales.
//
// `linear_int8` (weight-only): W[n, k] = q[n, k] * scales[n, k / group] (one scale per output row when
// group == K, llama.cpp's Q8_0 grid with group 32), x in 16-bit fixed point (below).
// `linear_w8a8`: per-channel int8 weights and x quantized per row (symmetric, dynamic: x[m, k] ~
// xq[m, k] * xs[m]); the products are integer (AVX-512 VNNI vpdpbusd: 64 multiply-adds an
// instruction, on x + 128 as unsigned bytes, the 128 * sum(q[n]) it adds taken off after; AVX2: signs
// moved onto the weights, |x| unsigned, vpmaddubsw + vpmaddwd, which cannot saturate for |q| <= 127),
// y = dot * xs[m] * scales[n]. `quantize_rows` is that activation quantization alone, for torch's
// integer GEMM on prompt chunks.
// Both walk one weight row at a time against every x row (up to 8 in registers; more rows: 8 at a
// time), each thread a contiguous range of rows: one sequential stream of weights a thread; or, with
// `tiled` (per channel), 4 weight rows against 4 x rows at a time, for batches; W8A8 also on AMX's
// int8 tiles (linear_amx.h) where the CPU has them (which loop runs: the caller's plan, by timing).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "convert.h"
#include "int_dot.h"
#include "linear_amx.h"
#include "linear_broadcast.h"

namespace {

using namespace tm_int;

using bf16 = c10::BFloat16;
constexpr int64_t MAX_ROWS = 8;  // x rows a pass holds in registers

// ---- weight-only: int8 weights against x in 16-bit fixed point (int_dot.h) ----

// sums[m] = sum over k of q[k] * scale(k) * x16[m, k] (times xs[m] later) for one weight row, MM x rows
// [MM, K] (row stride K). `group`: K (one scale; any K, a scalar tail) or a power of two from 32
// dividing K; each chunk of min(group, CHUNK) k shares one scale.
template <int MM>
inline void int8_row(const int8_t* q, const float* scales, int64_t group, int64_t K, const int16_t* x, float* sums) {
  constexpr int U = chains<MM>(), W = I16::W;
  const int64_t chunk = group == K ? CHUNK : std::min(group, CHUNK);  // a multiple of W
  const int shift = std::countr_zero(static_cast<uint64_t>(group));  // a power of two unless group == K
  if (chunk == W) {  // one vector a group (32 on AVX-512): U groups side by side, each scaled as it ends
    typename I16::F tot[MM][U];
    for (int m = 0; m < MM; ++m)
      for (int u = 0; u < U; ++u) tot[m][u] = I16::fzero();
    int64_t k = 0;
    for (; k + U * W <= K; k += U * W)
      for (int u = 0; u < U; ++u) {
        if ((u * W) % 64 == 0)
          _mm_prefetch(reinterpret_cast<const char*>(q + k + u * W + TM_I8_PREFETCH), TM_I8_HINT);
        const typename I16::V w = I16::load_w(q + k + u * W);
        const float s = scales[k / W + u];
        for (int m = 0; m < MM; ++m)
          tot[m][u] = I16::scaled(I16::dot(I16::zero(), w, I16::load_x(x + m * K + k + u * W)), s, tot[m][u]);
      }
    for (; k < K; k += W) {
      const typename I16::V w = I16::load_w(q + k);
      for (int m = 0; m < MM; ++m)
        tot[m][0] = I16::scaled(I16::dot(I16::zero(), w, I16::load_x(x + m * K + k)), scales[k / W], tot[m][0]);
    }
    for (int m = 0; m < MM; ++m) {
      float total = 0.f;
      for (int u = 0; u < U; ++u) total += I16::sum(tot[m][u]);
      sums[m] = total;
    }
    return;
  }
  typename I16::F total[MM];
  for (int m = 0; m < MM; ++m) total[m] = I16::fzero();
  int64_t k = 0;
  for (; k + chunk <= K; k += chunk) {
    typename I16::V acc[MM][U];
    for (int m = 0; m < MM; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = I16::zero();
    int64_t j = k;
    for (; j + U * W <= k + chunk; j += U * W)
      for (int u = 0; u < U; ++u) {
        if ((u * W) % 64 == 0)  // the same place PREFETCH_ROWS rows on, a cache line at a time
          _mm_prefetch(reinterpret_cast<const char*>(q + j + u * W + TM_I8_PREFETCH), TM_I8_HINT);
        const typename I16::V w = I16::load_w(q + j + u * W);
        for (int m = 0; m < MM; ++m) acc[m][u] = I16::dot(acc[m][u], w, I16::load_x(x + m * K + j + u * W));
      }
    for (; j < k + chunk; j += W) {  // chunk is a multiple of W
      const typename I16::V w = I16::load_w(q + j);
      for (int m = 0; m < MM; ++m) acc[m][0] = I16::dot(acc[m][0], w, I16::load_x(x + m * K + j));
    }
    const float s = scales[group == K ? 0 : k >> shift];
    for (int m = 0; m < MM; ++m) {  // the chunk's U partial sums together stay under 2^31
      typename I16::V chunk_sum = acc[m][0];
      for (int u = 1; u < U; ++u)
        if (u * W < chunk) chunk_sum = I16::add(chunk_sum, acc[m][u]);
      total[m] = I16::scaled(chunk_sum, s, total[m]);
    }
  }
  for (int m = 0; m < MM; ++m) {  // what is left (group == K only): under a chunk, vectors then scalars
    int64_t j = k;
    typename I16::V acc = I16::zero();
    for (; j + W <= K; j += W) acc = I16::dot(acc, I16::load_w(q + j), I16::load_x(x + m * K + j));
    int64_t rest = 0;
    for (; j < K; ++j) rest += static_cast<int64_t>(q[j]) * x[m * K + j];
    sums[m] = I16::sum(I16::scaled(acc, scales[0], total[m])) + static_cast<float>(rest) * scales[0];
  }
}

// Several x rows, per channel, K a multiple of the vector: TR weight rows x MM x rows at once, so each
// weight vector loaded meets MM x vectors and each x vector TR weight vectors (the row-at-a-time
// loop above loads MM x vectors for every weight vector: at 8 rows it reads more x than weights).
// sums[r * MAX_ROWS + m] for weight row r (of q, row stride K) and x row m.
constexpr int TR = 4;  // weight rows a tile
// The loops: one weight row at a time, TR x 4 tiles, AMX tiles (where built and granted; else rows),
// and for weight-only int8 on AVX2 the outer-product tiles of linear_broadcast.h (16 x rows and more;
// else, and for the rows short of a tile, TR x 4 tiles)
enum Mode : int64_t { ROWS = 0, TILES = 1, AMX = 2, BROADCAST = 3 };

template <int MM>
inline void int8_tile(const int8_t* q, int64_t K, const float* scales, const int16_t* x, float* sums) {
  constexpr int W = I16::W;
  float tot[TR][MM] = {};
  for (int64_t k = 0; k < K; k += CHUNK) {
    const int64_t k_end = std::min(K, k + CHUNK);
    typename I16::V acc[TR][MM];
    for (int r = 0; r < TR; ++r)
      for (int m = 0; m < MM; ++m) acc[r][m] = I16::zero();
    for (int64_t j = k; j < k_end; j += W) {
      typename I16::V w[TR];
      for (int r = 0; r < TR; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(q + r * K + j + TM_I8_PREFETCH), TM_I8_HINT);
        w[r] = I16::load_w(q + r * K + j);
      }
      for (int m = 0; m < MM; ++m) {
        const typename I16::V xv = I16::load_x(x + m * K + j);
        for (int r = 0; r < TR; ++r) acc[r][m] = I16::dot(acc[r][m], w[r], xv);
      }
    }
    for (int r = 0; r < TR; ++r)
      for (int m = 0; m < MM; ++m) tot[r][m] += I16::sum(I16::scaled(acc[r][m], 1.f, I16::fzero()));
  }
  for (int r = 0; r < TR; ++r)
    for (int m = 0; m < MM; ++m) sums[r * MAX_ROWS + m] = tot[r][m] * scales[r];
}

template <typename T>
void int8_impl(at::Tensor& out, const T* x, int64_t x_row, int64_t M, const at::Tensor& q, const at::Tensor& scales,
               int64_t group, const T* bias, bool tiled) {
  const int64_t N = q.size(0), K = q.size(1), G = scales.size(1);
  std::vector<int16_t> x16(M * K);
  std::vector<float> xs(M);
  to_int16_rows(x, x_row, M, K, x16.data(), xs.data());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  T* y = out.data_ptr<T>();
  const int64_t y_row = out.stride(0);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / K);  // ~128 KB of weights a thread at least
  if (tiled && group == K && K % I16::W == 0) {
    at::parallel_for(0, (N + TR - 1) / TR, std::max<int64_t>(1, grain / TR), [&](int64_t begin, int64_t end) {
      float sums[TR * MAX_ROWS];
      const int64_t n_end = std::min(N, end * TR);
      for (int64_t n = begin * TR; n < n_end; n += TR) {
        if (n + TR > n_end) {  // the last rows short of a tile: one at a time
          for (int64_t r = n; r < n_end; ++r)
            for (int64_t m0 = 0; m0 < M; ++m0) {
              int8_row<1>(qp + r * K, sp + r, K, K, x16.data() + m0 * K, sums);
              y[m0 * y_row + r] = from_float<T>(sums[0] * xs[m0] + (bias ? static_cast<float>(bias[r]) : 0.f));
            }
          break;
        }
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const int64_t mm = std::min<int64_t>(4, M - m0);
          const int16_t* xm = x16.data() + m0 * K;
          with_rows<4>(mm, [&]<int MM>() { int8_tile<MM>(qp + n * K, K, sp + n, xm, sums); });
          for (int r = 0; r < TR; ++r) {
            const float b = bias ? static_cast<float>(bias[n + r]) : 0.f;
            for (int64_t m = 0; m < mm; ++m)
              y[(m0 + m) * y_row + n + r] = from_float<T>(sums[r * MAX_ROWS + m] * xs[m0 + m] + b);
          }
        }
      }
    });
    return;
  }
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float sums[MAX_ROWS];
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
      const int64_t mm = std::min(MAX_ROWS, M - m0);
      const int16_t* xm = x16.data() + m0 * K;
      for (int64_t n = begin; n < end; ++n) {
        const int8_t* qn = qp + n * K;
        const float* sn = sp + n * G;
        with_rows<8>(mm, [&]<int MM>() { int8_row<MM>(qn, sn, group, K, xm, sums); });
        const float b = bias ? static_cast<float>(bias[n]) : 0.f;
        for (int64_t m = 0; m < mm; ++m) y[(m0 + m) * y_row + n] = from_float<T>(sums[m] * xs[m0 + m] + b);
      }
    }
  });
}

// ---- activations quantized per row (W8A8): int8, |xq| <= 127 ----
template <typename T>
void quantize_impl(const T* x, int64_t x_row, int64_t M, int64_t K, int8_t* xq, float* xs) {
  quantize_rows_to<int8_t, 127>(x, x_row, M, K, xq, xs);
}

// ---- w8a8: integer dot products ----
// dots[m] = sum over k of q[k] * xq[m, k] (exact, int32) for one weight row; `xu` holds the x rows as
// the kernel wants them (AVX-512 VNNI: xq + 128 as unsigned bytes; AVX2: |xq|), `wsum` = sum of q.
template <int MM>
inline void w8a8_row(const int8_t* q, int64_t K, const int8_t* xq, const uint8_t* xu, int32_t wsum, int32_t* dots) {
  int64_t k = 0;
  int32_t acc_s[MM] = {};
#if defined(__AVX512VNNI__)
  constexpr int U = chains<MM>();
  __m512i acc[MM][U];
  for (int m = 0; m < MM; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_si512();
  for (; k + U * 64 <= K; k += U * 64)
    for (int u = 0; u < U; ++u) {
      const __m512i w = _mm512_loadu_si512(q + k + u * 64);
      for (int m = 0; m < MM; ++m)
        acc[m][u] = _mm512_dpbusd_epi32(acc[m][u], _mm512_loadu_si512(xu + m * K + k + u * 64), w);
    }
  for (; k + 64 <= K; k += 64) {
    const __m512i w = _mm512_loadu_si512(q + k);
    for (int m = 0; m < MM; ++m) acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], _mm512_loadu_si512(xu + m * K + k), w);
  }
  for (int m = 0; m < MM; ++m) {
    __m512i t = acc[m][0];
    for (int u = 1; u < U; ++u) t = _mm512_add_epi32(t, acc[m][u]);
    acc_s[m] = _mm512_reduce_add_epi32(t) - 128 * wsum;
  }
  if (k < K) {  // the tail: 128 * (the tail's weights) was taken off with wsum; add it back
    int32_t tail_w = 0;
    for (int64_t j = k; j < K; ++j) tail_w += q[j];
    for (int m = 0; m < MM; ++m) acc_s[m] += 128 * tail_w;
  }
#elif defined(__AVX2__)
  (void)wsum;
  __m256i acc[MM];
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < MM; ++m) acc[m] = _mm256_setzero_si256();
  for (; k + 32 <= K; k += 32) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k));
    for (int m = 0; m < MM; ++m) {
      const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + k));
      const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xu + m * K + k));
      const __m256i pairs = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(w, xs));  // |x| * (w with x's sign)
      acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(pairs, ones));
    }
  }
  for (int m = 0; m < MM; ++m) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[m]), _mm256_extracti128_si256(acc[m], 1));
    s = _mm_hadd_epi32(s, s);
    s = _mm_hadd_epi32(s, s);
    acc_s[m] = _mm_cvtsi128_si32(s);
  }
#else
  (void)xu;
  (void)wsum;
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MM; ++m) acc_s[m] += static_cast<int32_t>(q[k]) * xq[m * K + k];
  for (int m = 0; m < MM; ++m) dots[m] = acc_s[m];
}

#if defined(__AVX512VNNI__)
// TR weight rows x MM x rows at once (as int8_tile), K a multiple of 64: dots[r * MAX_ROWS + m].
template <int MM>
inline void w8a8_tile(const int8_t* q, int64_t K, const uint8_t* xu, const int32_t* wsums, int32_t* dots) {
  __m512i acc[TR][MM];
  for (int r = 0; r < TR; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    __m512i w[TR];
    for (int r = 0; r < TR; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(q + r * K + k + TM_I8_PREFETCH), TM_I8_HINT);
      w[r] = _mm512_loadu_si512(q + r * K + k);
    }
    for (int m = 0; m < MM; ++m) {
      const __m512i xv = _mm512_loadu_si512(xu + m * K + k);
      for (int r = 0; r < TR; ++r) acc[r][m] = _mm512_dpbusd_epi32(acc[r][m], xv, w[r]);
    }
  }
  for (int r = 0; r < TR; ++r)
    for (int m = 0; m < MM; ++m) dots[r * MAX_ROWS + m] = _mm512_reduce_add_epi32(acc[r][m]) - 128 * wsums[r];
}
#endif

template <typename T>
void w8a8_impl(at::Tensor& out, const T* x, int64_t x_row, int64_t M, const at::Tensor& q, const at::Tensor& scales,
               const at::Tensor& wsums, const T* bias, int64_t mode) {
  const bool tiled = mode == TILES;
  const int64_t N = q.size(0), K = q.size(1);
  std::vector<int8_t> xq(M * K);
  std::vector<uint8_t> xu(M * K);
  std::vector<float> xs(M);
  quantize_impl(x, x_row, M, K, xq.data(), xs.data());
  for (int64_t i = 0; i < M * K; ++i)
#if defined(__AVX512VNNI__)
    xu[i] = static_cast<uint8_t>(xq[i] + 128);
#else
    xu[i] = static_cast<uint8_t>(std::abs(xq[i]));
#endif
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const int32_t* ws = wsums.data_ptr<int32_t>();
  T* y = out.data_ptr<T>();
  const int64_t y_row = out.stride(0);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / K);
  int64_t n_from = 0;  // rows below are done (by AMX)
#if defined(TM_AMX_INT8)
  if (mode == AMX) {
    n_from = tm_amx::linear_w8a8(xq.data(), M, qp, N, K, [&](int64_t m, int64_t n, int32_t dot) {
      y[m * y_row + n] = from_float<T>(static_cast<float>(dot) * xs[m] * sp[n] + (bias ? static_cast<float>(bias[n]) : 0.f));
    });
    if (n_from == N) return;
  }
#endif
#if defined(__AVX512VNNI__)
  if (tiled && K % 64 == 0 && N % TR == 0) {
    at::parallel_for(0, N / TR, std::max<int64_t>(1, grain / TR), [&](int64_t begin, int64_t end) {
      int32_t dots[TR * MAX_ROWS];
      for (int64_t n = begin * TR; n < end * TR; n += TR) {
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const int64_t mm = std::min<int64_t>(4, M - m0);
          const uint8_t* xm = xu.data() + m0 * K;
          with_rows<4>(mm, [&]<int MM>() { w8a8_tile<MM>(qp + n * K, K, xm, ws + n, dots); });
          for (int r = 0; r < TR; ++r) {
            const float b = bias ? static_cast<float>(bias[n + r]) : 0.f;
            for (int64_t m = 0; m < mm; ++m)
              y[(m0 + m) * y_row + n + r] =
                  from_float<T>(static_cast<float>(dots[r * MAX_ROWS + m]) * xs[m0 + m] * sp[n + r] + b);
          }
        }
      }
    });
    return;
  }
#else
  (void)tiled;
#endif
  at::parallel_for(n_from, N, grain, [&](int64_t begin, int64_t end) {
    int32_t dots[MAX_ROWS];
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
      const int64_t mm = std::min(MAX_ROWS, M - m0);
      const int8_t* xqm = xq.data() + m0 * K;
      const uint8_t* xum = xu.data() + m0 * K;
      for (int64_t n = begin; n < end; ++n) {
        const int8_t* qn = qp + n * K;
        with_rows<8>(mm, [&]<int MM>() { w8a8_row<MM>(qn, K, xqm, xum, ws[n], dots); });
        const float b = bias ? static_cast<float>(bias[n]) : 0.f;
        for (int64_t m = 0; m < mm; ++m)
          y[(m0 + m) * y_row + n] = from_float<T>(static_cast<float>(dots[m]) * xs[m0 + m] * sp[n] + b);
      }
    }
  });
}

// The columns [0, done) of out by linear_broadcast.h's tiles, x widened to float32 (returns done: 0
// where those tiles are not built or x has fewer rows than a panel).
template <typename T>
int64_t int8_broadcast(at::Tensor& out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                       int64_t group, const T* bias) {
#if defined(TM_BROADCAST_TILES)
  const int64_t M = x.size(0), K = x.size(1);
  if (M < tm_broadcast::MP) return 0;
  std::vector<float> widened;
  int64_t x_row = x.stride(0);
  const float* xf = tm_panels::float_rows(x.data_ptr<T>(), x_row, M, K, widened);
  return tm_broadcast::linear_int8(xf, x_row, M, q.data_ptr<int8_t>(), scales.data_ptr<float>(), group, q.size(0), K,
                                   bias, out.data_ptr<T>(), out.stride(0));
#else
  return 0;
#endif
}

void check_common(const at::Tensor& out, const at::Tensor& x, const at::Tensor& q,
                  const c10::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [M, K] with contiguous rows");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar && q.size(1) == x.size(1), op,
              ": weight must be contiguous int8 [N, K] for x [M, K]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == q.size(0), op,
              ": out must be [M, N] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x must be float32 or bfloat16");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), op, ": out must be in x's dtype");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                                     bias->numel() == q.size(0)),
              op, ": bias must be contiguous [N] in x's dtype");
}

}  // namespace

namespace tokenmill {

// out [M, N] = x [M, K] @ (q * scales)^T (+ bias): q int8 [N, K], scales float32 [N, K / group].
void linear_int8(at::Tensor out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t group,
                 const c10::optional<at::Tensor>& bias, int64_t mode) {
  TORCH_CHECK(mode == ROWS || mode == TILES || mode == AMX || mode == BROADCAST,
              "linear_int8: mode 0 (rows), 1 (tiles), 2 (AMX) or 3 (outer-product tiles)");
  check_common(out, x, q, bias, "linear_int8");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(group == K || (group >= 32 && (group & (group - 1)) == 0 && K % group == 0),
              "linear_int8: group must be K (per channel) or a power of two from 32 dividing K, got ", group);
  TORCH_CHECK(scales.dim() == 2 && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.size(0) == q.size(0) && scales.size(1) == K / group,
              "linear_int8: scales must be contiguous float32 [N, K / group]");
  if (M == 0 || N == 0) return;
  if (mode == AMX) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_int8: the AMX mode takes bfloat16 x");
    int64_t done = 0;
#if defined(TM_AMX)
    // the weights as bfloat16 tiles: int8 values exact (per channel: the scale applied to the sums),
    // per group multiplied by their group's scale first
    const int8_t* qp = q.data_ptr<int8_t>();
    const float* sp = scales.data_ptr<float>();
    const int64_t G = K / group;
    const int shift = std::countr_zero(static_cast<uint64_t>(group));
    const bool per_channel = group == K;
    bf16* y = out.data_ptr<bf16>();
    const bf16* b = bias ? bias->data_ptr<bf16>() : nullptr;
    const int64_t y_row = out.stride(0);
    const auto rows = [&](int64_t n, int64_t k) {
      const int8_t* p = qp + n * K + k;
      __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
      if (!per_channel) {
        const __m512 s = _mm512_set1_ps(sp[n * G + (k >> shift)]);
        lo = _mm512_mul_ps(lo, s);
        hi = _mm512_mul_ps(hi, s);
      }
      return tm_amx::to_bf16x32(lo, hi);
    };
    done = tm_amx::linear_rows_bf16(x.data_ptr<bf16>(), x.stride(0), M, N, K, rows, [&](int64_t m, int64_t n, float sum) {
      y[m * y_row + n] = from_float<bf16>((per_channel ? sum * sp[n] : sum) + (b ? static_cast<float>(b[n]) : 0.f));
    });
#endif
    if (done < N) {  // the rows short of a block (or no tiles): one weight row at a time
      const c10::optional<at::Tensor> rest_bias = bias ? c10::optional<at::Tensor>(bias->narrow(0, done, N - done)) : bias;
      linear_int8(out.narrow(1, done, N - done), x, q.narrow(0, done, N - done), scales.narrow(0, done, N - done),
                  group, rest_bias, ROWS);
    }
    return;
  }
  if (mode == BROADCAST) {
    const int64_t done = x.scalar_type() == at::kFloat
                             ? int8_broadcast<float>(out, x, q, scales, group, bias ? bias->data_ptr<float>() : nullptr)
                             : int8_broadcast<bf16>(out, x, q, scales, group, bias ? bias->data_ptr<bf16>() : nullptr);
    if (done < N) {  // the rows short of a tile (or no such tiles here): TR x 4 tiles
      const c10::optional<at::Tensor> rest_bias = bias ? c10::optional<at::Tensor>(bias->narrow(0, done, N - done)) : bias;
      linear_int8(out.narrow(1, done, N - done), x, q.narrow(0, done, N - done), scales.narrow(0, done, N - done),
                  group, rest_bias, TILES);
    }
    return;
  }
  const bool tiled = mode == TILES;
  if (x.scalar_type() == at::kFloat)
    int8_impl<float>(out, x.data_ptr<float>(), x.stride(0), M, q, scales, group,
                     bias ? bias->data_ptr<float>() : nullptr, tiled);
  else
    int8_impl<bf16>(out, x.data_ptr<bf16>(), x.stride(0), M, q, scales, group, bias ? bias->data_ptr<bf16>() : nullptr,
                    tiled);
}

// out [M, N] = dynamic int8 x [M, K] @ (q * scales)^T (+ bias): q int8 [N, K] (|q| <= 127), scales
// float32 [N], wsums int32 [N] (each row's sum of q).
void linear_w8a8(at::Tensor out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                 const at::Tensor& wsums, const c10::optional<at::Tensor>& bias, int64_t mode) {
  TORCH_CHECK(mode == ROWS || mode == TILES || mode == AMX, "linear_w8a8: mode 0 (rows), 1 (tiles) or 2 (AMX)");
  check_common(out, x, q, bias, "linear_w8a8");
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.size(0) == q.size(0),
              "linear_w8a8: scales must be contiguous float32 [N]");
  TORCH_CHECK(wsums.dim() == 1 && wsums.is_contiguous() && wsums.scalar_type() == at::kInt &&
                  wsums.size(0) == q.size(0),
              "linear_w8a8: wsums must be contiguous int32 [N]");
  if (x.size(0) == 0 || q.size(0) == 0) return;
  if (x.scalar_type() == at::kFloat)
    w8a8_impl<float>(out, x.data_ptr<float>(), x.stride(0), x.size(0), q, scales, wsums,
                     bias ? bias->data_ptr<float>() : nullptr, mode);
  else
    w8a8_impl<bf16>(out, x.data_ptr<bf16>(), x.stride(0), x.size(0), q, scales, wsums,
                    bias ? bias->data_ptr<bf16>() : nullptr, mode);
}

// Whether linear_int8's and linear_int4's AMX mode (bfloat16 tiles) runs here.
bool amx_bf16_ready() {
#if defined(TM_AMX)
  return tm_amx::enabled();
#else
  return false;
#endif
}

// Whether linear_w8a8's AMX mode runs here: built for a CPU with AMX's int8 tiles, and granted by Linux.
bool w8a8_amx_ready() {
#if defined(TM_AMX_INT8)
  return tm_amx::enabled();
#else
  return false;
#endif
}

// (xq int8 [M, K], xs float32 [M]): x [M, K] (float32 or bfloat16) quantized per row, symmetric.
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quantize_rows: x must be [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar)), xs = at::empty({M}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat)
    quantize_impl(x.data_ptr<float>(), x.stride(0), M, K, xq.data_ptr<int8_t>(), xs.data_ptr<float>());
  else if (x.scalar_type() == at::kBFloat16)
    quantize_impl(x.data_ptr<bf16>(), x.stride(0), M, K, xq.data_ptr<int8_t>(), xs.data_ptr<float>());
  else
    TORCH_CHECK(false, "quantize_rows: x must be float32 or bfloat16");
  return {xq, xs};
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("linear_int8(Tensor(a!) out, Tensor x, Tensor q, Tensor scales, int group, Tensor? bias, int mode) -> ()");
  m.impl("linear_int8", c10::DispatchKey::CPU, &tokenmill::linear_int8);
  m.def(
      "linear_w8a8(Tensor(a!) out, Tensor x, Tensor q, Tensor scales, Tensor wsums, Tensor? bias, int mode) -> ()");
  m.impl("linear_w8a8", c10::DispatchKey::CPU, &tokenmill::linear_w8a8);
  m.def("w8a8_amx_ready() -> bool", &tokenmill::w8a8_amx_ready);
  m.def("amx_bf16_ready() -> bool", &tokenmill::amx_bf16_ready);
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
  m.impl("quantize_rows", c10::DispatchKey::CPU, &tokenmill::quantize_rows);
}

// The prompt product on GGUF's blocks: y = x @ W^T for many x rows (a prompt chunk), W as the file's
// blocks [N, row bytes] (gguf_formats.h), in integers as the decode product (gguf_blocks.cpp) but laid
// out for many rows, so that a prompt no longer dequantizes W into floats for a float GEMM.
//
// x is rounded to int8 once a call, every row in parallel: per 256 for the K-quants (a float scale and
// the integer sums of each 16 and 32, gguf_kdot.h), per 32 for the 32-weight types (a float scale and
// the float sums of each 16). Threads then take tiles of TILE_BYTES of weight rows (columns of y); a
// tile stays in the core's L2 while every tile of GEMM_ROWS x rows passes over it, and each weight row
// of it is unpacked once per x tile and dotted with all of that tile's rows while its bytes are in
// registers (row_dot / krow: vpmaddubsw / vpmaddwd, AVX-512 VNNI's vpdpwssd where the build has it,
// the scalar reference without AVX2). So each weight block is read from memory once a call, decoded
// M / GEMM_ROWS times, and y is exactly x' @ W^T up to float32 summation (x' the int8-rounded x):
// the same sums in the same order as `gguf_linear` gives each row.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "convert.h"
#include "gguf_formats.h"
#include "gguf_x16.h"
#include "int_dot.h"
#include "linear_broadcast.h"

namespace {

using namespace tm_gguf;
using bf16 = c10::BFloat16;
#ifndef TM_GGUF_GEMM_ROWS
#define TM_GGUF_GEMM_ROWS 8
#endif
#ifndef TM_GGUF_TILE_KB
#define TM_GGUF_TILE_KB 96
#endif
constexpr int GEMM_ROWS = TM_GGUF_GEMM_ROWS;                 // x rows a weight row is dotted with while unpacked
static_assert(GEMM_ROWS == XG, "krow's groups of x rows");
constexpr int64_t TILE_BYTES = int64_t{TM_GGUF_TILE_KB} << 10;  // weight bytes a tile (held in L2 across x tiles)

// y[m0 .. m0 + mm, n] for the tile's weight rows n in [n0, n1), x tile by x tile
template <typename Dot, typename T>
void tile_rows(int64_t n0, int64_t n1, int64_t M, T* y, int64_t y_row, Dot&& dot) {
  for (int64_t m0 = 0; m0 < M; m0 += GEMM_ROWS)
    tm_int::with_rows<GEMM_ROWS>(std::min<int64_t>(GEMM_ROWS, M - m0), [&]<int MM>() {
      for (int64_t n = n0; n < n1; ++n) {
        float sums[MM];
        dot.template operator()<MM>(n, m0, sums);
        for (int m = 0; m < MM; ++m) y[(m0 + m) * y_row + n] = from_float<T>(sums[m]);
      }
    });
}

// threads over tiles of weight rows; `tile(n0, n1)` computes y's columns [n0, n1)
template <typename Fn>
void over_tiles(int64_t N, int64_t row_bytes, Fn&& tile) {
  const int64_t rows = std::max<int64_t>(1, TILE_BYTES / std::max<int64_t>(1, row_bytes));
  const int64_t tiles = (N + rows - 1) / rows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) tile(t * rows, std::min(N, (t + 1) * rows));
  });
}

// the 32-weight types: x rounded per 32, row by row in parallel
template <typename F, typename T>
void gemm32(at::Tensor& out, const T* x, int64_t x_row, int64_t M, int64_t K, const at::Tensor& w) {
  const int64_t N = w.size(0), R = K / RUN, G = K / 16, row_bytes = w.size(1);
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * R), xs16(M * G);
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) quantize_x(x + m * x_row, x_row, 1, K, xq.data() + m * K, xs.data() + m * R, xs16.data() + m * G);
  });
  const uint8_t* wp = w.data_ptr<uint8_t>();
  T* y = out.data_ptr<T>();
  over_tiles(N, row_bytes, [&](int64_t n0, int64_t n1) {
    tile_rows(n0, n1, M, y, out.stride(0), [&]<int MM>(int64_t n, int64_t m0, float* sums) {
      const XRows xr{xq.data() + m0 * K, xs.data() + m0 * R, xs16.data() + m0 * G, K};
      float s[MM];
      row_dot<F, MM>(wp + n * row_bytes, xr, s);
      for (int m = 0; m < MM; ++m) sums[m] = s[m];
    });
  });
}

// the K-quants: x rounded per 256 (gguf_kdot.h's KX), row by row in parallel
template <int TYPE, typename T>
void gemm256(at::Tensor& out, const T* x, int64_t x_row, int64_t M, int64_t K, const at::Tensor& w) {
  const int64_t N = w.size(0), row_bytes = w.size(1);
  KX xk;
  quantize_x256(x, x_row, M, K, xk, true);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  T* y = out.data_ptr<T>();
  over_tiles(N, row_bytes, [&](int64_t n0, int64_t n1) {
    tile_rows(n0, n1, M, y, out.stride(0), [&]<int MM>(int64_t n, int64_t m0, float* sums) {
      krow<TYPE, MM>(wp + n * row_bytes, xk, m0, sums);
    });
  });
}

template <typename F, typename T>
void gemm_any(at::Tensor& out, const T* x, int64_t x_row, int64_t M, int64_t K, const at::Tensor& w) {
  if constexpr (F::W == QK)
    gemm256<k_type<F>()>(out, x, x_row, M, K, w);
  else
    gemm32<F>(out, x, x_row, M, K, w);
}

// The columns [0, done) of out through linear_broadcast.h's float32 outer-product tiles, each tile's
// weight rows dequantized into the thread's scratch once for all the x panels (returns done: 0 where
// those tiles are not built, on AVX2 alone, or x has fewer rows than a panel).
template <typename F, typename T>
int64_t widened_any(at::Tensor& out, const T* x, int64_t x_row, int64_t M, int64_t K, const at::Tensor& w) {
#if defined(TM_BROADCAST_TILES)
  if (M < tm_broadcast::MP) return 0;
  std::vector<float> widened;
  const float* xp = tm_panels::float_rows(x, x_row, M, K, widened);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  const auto rows_of = [&](int64_t n0, float* scratch) -> const float* {
    for (int r = 0; r < tm_broadcast::NR; ++r) dequant_row<F>(wp + (n0 + r) * row_bytes, K, scratch + r * K);
    return scratch;
  };
  return tm_broadcast::linear_tiles<false>(xp, x_row, M, w.size(0), K, rows_of, static_cast<const T*>(nullptr),
                                           out.data_ptr<T>(), out.stride(0));
#else
  return 0;
#endif
}

}  // namespace

namespace tokenmill {

// out [M, N] (rows contiguous; may be a column slice of a wider output) = x [M, K] @ W^T, W as blocks
// [N, row bytes] of GGML type `type`; x and out float32 or bfloat16, one dtype. The same values as
// `gguf_linear`, laid out for many rows.
void gguf_gemm(at::Tensor out, const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "gguf_gemm: x must be [M, K] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == blocks.size(0),
              "gguf_gemm: out must be [M, N] with contiguous rows");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  out.scalar_type() == x.scalar_type(),
              "gguf_gemm: x and out float32 or bfloat16, one dtype");
  const int64_t M = x.size(0), K = x.size(1);
  if (gguf_x16_type(type)) return gguf_x16_linear(out, x, blocks, type);  // (one product for any rows)
  check_blocks("gguf_gemm", blocks, type, K);
  if (M == 0 || blocks.size(0) == 0) return;
  with_format(type, [&]<typename F>() {
    if (x.scalar_type() == at::kFloat)
      gemm_any<F, float>(out, x.data_ptr<float>(), x.stride(0), M, K, blocks);
    else
      gemm_any<F, bf16>(out, x.data_ptr<bf16>(), x.stride(0), M, K, blocks);
  });
}

// gguf_gemm's product in float32 arithmetic on AVX2: W's rows dequantized a tile of 6 at a time (as
// `gguf_dequant` writes them) for the dense kernel's outer-product tiles, x not rounded to int8; the
// rows short of a tile, and every row where those tiles are not built, through gguf_gemm.
void gguf_gemm_widened(at::Tensor out, const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) &&
                  out.size(1) == blocks.size(0) && out.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gguf_gemm_widened: x [M, K] and out [M, N], rows contiguous, float32 or bfloat16, one dtype");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  if (gguf_x16_type(type)) return gguf_x16_linear(out, x, blocks, type);
  check_blocks("gguf_gemm_widened", blocks, type, K);
  if (M == 0 || N == 0) return;
  int64_t done = 0;
  with_format(type, [&]<typename F>() {
    done = x.scalar_type() == at::kFloat ? widened_any<F, float>(out, x.data_ptr<float>(), x.stride(0), M, K, blocks)
                                         : widened_any<F, bf16>(out, x.data_ptr<bf16>(), x.stride(0), M, K, blocks);
  });
  if (done < N) gguf_gemm(out.narrow(1, done, N - done), x, blocks.narrow(0, done, N - done), type);
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("gguf_gemm(Tensor(a!) out, Tensor x, Tensor blocks, int type) -> ()");
  m.impl("gguf_gemm", c10::DispatchKey::CPU, &tokenmill::gguf_gemm);
  m.def("gguf_gemm_widened(Tensor(a!) out, Tensor x, Tensor blocks, int type) -> ()");
  m.impl("gguf_gemm_widened", c10::DispatchKey::CPU, &tokenmill::gguf_gemm_widened);
}

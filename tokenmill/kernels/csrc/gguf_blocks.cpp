// GGUF's quantized blocks used as they are stored: a matrix is its file bytes, [N, K / W * block bytes]
// uint8 (W weights a block, a row's blocks along K), and these ops read them directly.
//
// The block formats and the per-row products: gguf_formats.h.
//
// `gguf_dequant` writes rows of W (float32, or rounded to bfloat16 as torch rounds) for a prompt's
// dequantize-then-GEMM and for embedding lookups. `gguf_linear` is the decode product y = x @ W^T for few
// x rows. The K-quants (gguf_kdot.h): x rounded to int8 per 256 (llama.cpp's Q8_K), a block's sums
// exact in int32 with its integer scales, two float steps a block. The 32-weight types: x rounded to
// int8 in runs of 32 (one float scale a run, llama.cpp's Q8_0), each block's bytes multiplied with the x
// rows' (vpmaddubsw; signed q, and q - OFF, through vpsignb) while they are in registers, one float step
// a block; the b terms take the x runs' float sums. So y is exactly x' @ W^T up to float32 summation,
// x' the int8-rounded x. Threads take ranges of weight rows, each range read from several places at once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "gguf_formats.h"
#include "gguf_x16.h"
#include "int_dot.h"

namespace {

using namespace tm_gguf;
using bf16 = c10::BFloat16;

// A thread's weight rows [begin, end) taken from S places at once (row begin + s * len / S + i for each
// i, s), so that S streams of weights are in flight, not one: one x row leaves the core idle on one
// stream's misses (measured 4 streams ~1.3x one at one x row); 8 x rows are compute-bound and keep one.
constexpr int streams(int rows) { return rows == 1 ? 4 : rows <= 4 ? 2 : 1; }

template <int S, typename Fn>
inline void interleaved(int64_t begin, int64_t end, Fn&& row) {
  const int64_t h = (end - begin) / S;
  for (int64_t i = 0; i < h; ++i)
    for (int s = 0; s < S; ++s) row(begin + s * h + i);
  for (int64_t n = begin + S * h; n < end; ++n) row(n);
}

template <typename F, typename T>
void linear_impl(at::Tensor& out, const T* x, int64_t x_row, int64_t M, int64_t K, const at::Tensor& w) {
  const int64_t N = w.size(0), R = K / RUN, row_bytes = w.size(1);
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * R), xs16(M * (K / 16));
  quantize_x(x, x_row, M, K, xq.data(), xs.data(), xs16.data());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  T* y = out.data_ptr<T>();
  const int64_t y_row = out.stride(0);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_bytes));  // ~64 KB
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
      const int64_t mm = std::min(MAX_ROWS, M - m0);
      const XRows xr{xq.data() + m0 * K, xs.data() + m0 * R, xs16.data() + m0 * (K / 16), K};
      tm_int::with_rows<MAX_ROWS>(mm, [&]<int MM>() {
        interleaved<streams(MM)>(begin, end, [&](int64_t n) {
          float sums[MM];
          row_dot<F, MM>(wp + n * row_bytes, xr, sums);
          for (int m = 0; m < MM; ++m) y[(m0 + m) * y_row + n] = from_float<T>(sums[m]);
        });
      });
    }
  });
}

// the K-quant types' product (gguf_kdot.h): x rounded per 256, each block's sums in integers
template <int TYPE, typename T>
void klinear_impl(at::Tensor& out, const T* x, int64_t x_row, int64_t M, int64_t K, const at::Tensor& w) {
  const int64_t N = w.size(0), row_bytes = w.size(1);
  tm_gguf::KX xk;
  tm_gguf::quantize_x256(x, x_row, M, K, xk, M > 1);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  T* y = out.data_ptr<T>();
  const int64_t y_row = out.stride(0);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_bytes));  // ~64 KB
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS)
      tm_int::with_rows<MAX_ROWS>(std::min(MAX_ROWS, M - m0), [&]<int MM>() {
        interleaved<streams(MM)>(begin, end, [&](int64_t n) {
          float sums[MM];
          tm_gguf::krow<TYPE, MM>(wp + n * row_bytes, xk, m0, sums);
          for (int m = 0; m < MM; ++m) y[(m0 + m) * y_row + n] = from_float<T>(sums[m]);
        });
      });
  });
}

template <typename F, typename T>
void linear_any(at::Tensor& out, const T* x, int64_t x_row, int64_t M, int64_t K, const at::Tensor& w) {
  if constexpr (F::W == QK)
    klinear_impl<k_type<F>()>(out, x, x_row, M, K, w);
  else
    linear_impl<F>(out, x, x_row, M, K, w);
}

// f.template operator()<F>() for GGML type number `type`
}  // namespace

namespace tokenmill {

// out [R, K] (float32 or bfloat16, contiguous rows) = rows of W, W as blocks [N, row bytes] of GGML type
// `type`: rows `ids` [R] (int64) when given, else rows row0 .. row0 + R - 1.
void gguf_dequant(at::Tensor out, const at::Tensor& blocks, int64_t type, const c10::optional<at::Tensor>& ids,
                  int64_t row0) {
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1, "gguf_dequant: out must be [R, K] with contiguous rows");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "gguf_dequant: out float32 or bfloat16");
  const int64_t R = out.size(0), K = out.size(1), N = blocks.size(0);
  const bool x16 = gguf_x16_type(type);
  if (x16)
    gguf_x16_check("gguf_dequant", blocks, type, K);
  else
    check_blocks("gguf_dequant", blocks, type, K);
  const int64_t* idp = nullptr;
  if (ids) {
    TORCH_CHECK(ids->scalar_type() == at::kLong && ids->is_contiguous() && ids->numel() == R,
                "gguf_dequant: ids must be contiguous int64 [R]");
    idp = ids->data_ptr<int64_t>();
    for (int64_t i = 0; i < R; ++i) TORCH_CHECK(idp[i] >= 0 && idp[i] < N, "gguf_dequant: row ", idp[i], " out of range");
  } else {
    TORCH_CHECK(row0 >= 0 && row0 + R <= N, "gguf_dequant: rows ", row0, " + ", R, " out of range");
  }
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1), o_row = out.stride(0);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, K));
  with_format(x16 ? type - 100 : type, [&]<typename F>() {
    at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> file_row(x16 ? K / F::W * F::BYTES : 0);  // (x16: the row as the file held it)
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n = idp ? idp[i] : row0 + i;
        const uint8_t* row = bp + n * row_bytes;
        if (x16) gguf_x16_file_row(bp, row_bytes, type, K, n, file_row.data()), row = file_row.data();
        if (out.scalar_type() == at::kFloat)
          dequant_row<F>(row, K, out.data_ptr<float>() + i * o_row);
        else
          dequant_row<F>(row, K, out.data_ptr<bf16>() + i * o_row);
      }
    });
  });
}

// out [M, N] (rows contiguous; may be a column slice of a wider output) = x [M, K] @ W^T, W as blocks
// [N, row bytes] of GGML type `type`; x and out float32 or bfloat16, one dtype.
void gguf_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "gguf_linear: x must be [M, K] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == blocks.size(0),
              "gguf_linear: out must be [M, N] with contiguous rows");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  out.scalar_type() == x.scalar_type(),
              "gguf_linear: x and out float32 or bfloat16, one dtype");
  const int64_t M = x.size(0), K = x.size(1);
  if (gguf_x16_type(type)) return gguf_x16_linear(out, x, blocks, type);
  check_blocks("gguf_linear", blocks, type, K);
  if (M == 0 || blocks.size(0) == 0) return;
  with_format(type, [&]<typename F>() {
    if (x.scalar_type() == at::kFloat)
      linear_any<F, float>(out, x.data_ptr<float>(), x.stride(0), M, K, blocks);
    else
      linear_any<F, bf16>(out, x.data_ptr<bf16>(), x.stride(0), M, K, blocks);
  });
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("gguf_dequant(Tensor(a!) out, Tensor blocks, int type, Tensor? ids, int row0) -> ()");
  m.impl("gguf_dequant", c10::DispatchKey::CPU, &tokenmill::gguf_dequant);
  m.def("gguf_linear(Tensor(a!) out, Tensor x, Tensor blocks, int type) -> ()");
  m.impl("gguf_linear", c10::DispatchKey::CPU, &tokenmill::gguf_linear);
}

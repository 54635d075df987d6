// The 16-row repacked K-quant matrices (gguf_x16.cpp): their type numbers and entry points, for the
// GGUF ops (gguf_blocks.cpp, gguf_gemm.cpp) that take them beside the file's own block types.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace tm_x16 {
constexpr int64_t ROWS = 16;                    // W's rows a group
constexpr int64_t Q4_016 = 102, Q4_116 = 103, Q8_016 = 108, Q4_K16 = 112, Q5_K16 = 113, Q6_K16 = 114;  // +100
}  // namespace tm_x16

namespace tokenmill {
bool gguf_x16_type(int64_t type);
void gguf_x16_check(const char* op, const at::Tensor& w, int64_t type, int64_t K);
// out [M, N] = x [M, K] @ W^T for any M, W repacked (checked here)
void gguf_x16_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& blocks, int64_t type);
// row n of W as the file stored it (K / 256 blocks of the file's type)
void gguf_x16_file_row(const uint8_t* w, int64_t row_bytes16, int64_t type, int64_t K, int64_t n, uint8_t* row);
}  // namespace tokenmill

// The native ops' entry points (each registered under torch.ops.tokenmill_cpu by its own file), for
// C++ callers in this library: decode_layer.cpp chains them without a trip through Python.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <optional>

namespace tokenmill {

void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_starts,
                     const at::Tensor& query_lens, int64_t block_size, double scale, std::optional<int64_t> window);
// The caches' shapes and dtypes checked (attention.cpp), for paged_attention and write_kv alike.
void check_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t block_size, int64_t dim,
                    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale);
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
              const at::Tensor& slots, int64_t block_size);
void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
void silu_and_mul(at::Tensor out, const at::Tensor& x);
void rotary(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin);
void argmax_rows(at::Tensor out, const at::Tensor& x);
void linear(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
void linear_int8(at::Tensor out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t group,
                 const c10::optional<at::Tensor>& bias, int64_t mode);
void linear_int4(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                 const at::Tensor& mins, int64_t group, const c10::optional<at::Tensor>& bias, bool amx,
                 bool many_rows);
void linear_w8a8(at::Tensor out, const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                 const at::Tensor& wsums, const c10::optional<at::Tensor>& bias, int64_t mode);
void gguf_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& blocks, int64_t type);
void gguf_dequant(at::Tensor out, const at::Tensor& blocks, int64_t type, const c10::optional<at::Tensor>& ids,
                  int64_t row0);

}  // namespace tokenmill

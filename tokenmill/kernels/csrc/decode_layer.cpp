// The decoder layers of the Llama family for a step of decodes, in one call (`decode_stack`): per
// layer, the ops that DecoderLayer.forward calls one by one from Python (RMSNorm with the residual
// add, the QKV projection, rotary embeddings, the KV write, paged attention, the output projection,
// the second norm, gate/up, SiLU-and-mul, down), chained here in the same order on the same kernels,
// so the result is the same to the bit. What it saves is Python: ~20 torch calls and ~10 module calls
// a layer, then the call a layer itself (1.11-1.29x on the step at 1-16 sequences on the 2-core AVX2
// machine: benchmarks/fused_decode.py). Each projection takes the native few-row kernel or torch's
// GEMM as the caller's plan says (`native`).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "ops.h"

namespace {

// x [M, in] @ w[out, in]^T (+ b) -> [M, out], by the native kernel or torch's GEMM.
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b, bool native) {
  if (!native) return at::linear(x, w, b);
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  tokenmill::linear(out, x, w, b);
  return out;
}

// Returns (this layer's MLP output [T, hidden], the residual stream before it [T, hidden]), as
// DecoderLayer.forward does. `residual` None: the first layer (x is the embeddings, kept as the
// residual); otherwise x (the previous MLP output) and residual are updated in place by the add + norm.
std::tuple<at::Tensor, at::Tensor> decode_layer(
    at::Tensor x, const c10::optional<at::Tensor>& residual_in, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv_w, const c10::optional<at::Tensor>& qkv_b,
    const at::Tensor& o_w, const c10::optional<at::Tensor>& o_b, const at::Tensor& gate_up_w,
    const c10::optional<at::Tensor>& gate_up_b, const at::Tensor& down_w, const c10::optional<at::Tensor>& down_b,
    c10::List<bool> native, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const at::Tensor& positions,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_starts,
    const at::Tensor& query_lens, int64_t block_size, double scale, std::optional<int64_t> window) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layer: x must be contiguous [T, hidden]");
  TORCH_CHECK(native.size() == 4, "decode_layer: native needs one flag per projection (qkv, o, gate_up, down)");
  const int64_t tokens = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  at::Tensor residual, h;
  if (residual_in.has_value()) {
    residual = *residual_in;
    tokenmill::add_rms_norm(x, residual, input_norm, eps);  // residual += x; x = norm(residual)
    h = x;
  } else {
    residual = x;
    h = at::empty_like(x);
    tokenmill::rms_norm(h, x, input_norm, eps);
  }
  const at::Tensor qkv = project(h, qkv_w, qkv_b, native[0]);  // [T, q + 2 kv]
  // q and k heads side by side: one rotation for both, in place
  const at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim});
  tokenmill::rotary(qk, positions, cos, sin);
  const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
  tokenmill::write_kv(k, v, k_cache, v_cache, slots, block_size);
  at::Tensor attn = at::empty({tokens, num_heads, head_dim}, x.options());
  tokenmill::paged_attention(attn, q, k_cache, v_cache, block_tables, seq_lens, query_starts, query_lens, block_size,
                             scale, window);
  at::Tensor o = project(attn.view({tokens, q_size}), o_w, o_b, native[1]);
  tokenmill::add_rms_norm(o, residual, post_norm, eps);  // residual += o; o = norm(residual)
  const at::Tensor gate_up = project(o, gate_up_w, gate_up_b, native[2]);
  at::Tensor act = at::empty({tokens, gate_up.size(1) / 2}, x.options());
  tokenmill::silu_and_mul(act, gate_up);
  return {project(act, down_w, down_b, native[3]), residual};
}

// Every decoder layer of the model for one step: decode_layer for layer i with its
// tensors at i (norms: input and post-attention norm of each layer in turn; weights and biases: qkv,
// o, gate_up, down of each layer; caches: K and V of each layer). Returns as decode_layer does after
// the last layer. What it saves over a call a layer is the Python between them (~60-90 us a layer on
// the 2-core machines: module attribute lookups and the boxing of ~30 arguments).
std::tuple<at::Tensor, at::Tensor> decode_stack(
    at::Tensor x, at::TensorList norms, at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& biases,
    at::TensorList caches, double eps, c10::List<bool> native, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_starts, const at::Tensor& query_lens, int64_t block_size, double scale,
    const c10::List<c10::optional<int64_t>>& windows) {
  const int64_t layers = static_cast<int64_t>(windows.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers && static_cast<int64_t>(caches.size()) == 2 * layers &&
                  static_cast<int64_t>(weights.size()) == 4 * layers && static_cast<int64_t>(biases.size()) == 4 * layers,
              "decode_stack: per layer 2 norms, 4 weights, 4 biases, 2 caches and a window");
  c10::optional<at::Tensor> residual;
  at::Tensor h = std::move(x);
  for (int64_t i = 0; i < layers; ++i) {
    const c10::optional<int64_t> window = windows.get(i);
    auto [out, res] = decode_layer(h, residual, norms[2 * i], norms[2 * i + 1], eps, weights[4 * i],
                                   biases.get(4 * i), weights[4 * i + 1], biases.get(4 * i + 1), weights[4 * i + 2],
                                   biases.get(4 * i + 2), weights[4 * i + 3], biases.get(4 * i + 3), native, num_heads,
                                   num_kv_heads, head_dim, positions, cos, sin, caches[2 * i], caches[2 * i + 1], slots,
                                   block_tables, seq_lens, query_starts, query_lens, block_size, scale,
                                   window.has_value() ? std::optional<int64_t>(*window) : std::nullopt);
    h = std::move(out);
    residual = std::move(res);
  }
  TORCH_CHECK(residual.has_value(), "decode_stack: no layers");
  return {h, *residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def(
      "decode_stack(Tensor(a!) x, Tensor[] norms, Tensor[] weights, Tensor?[] biases, Tensor(b!)[] caches, float eps, "
      "bool[] native, int num_heads, int num_kv_heads, int head_dim, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor slots, Tensor block_tables, Tensor seq_lens, Tensor query_starts, Tensor query_lens, int block_size, "
      "float scale, int?[] windows) -> (Tensor, Tensor)");
  m.impl("decode_stack", c10::DispatchKey::CPU, &decode_stack);
}

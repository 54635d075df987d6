// The decoder layers of the Llama family for a step of decodes, in one call (`decode_stack`): per
// layer, the ops that DecoderLayer.forward calls one by one from Python (RMSNorm with the residual
// add, the QKV projection, rotary embeddings, the KV write, paged attention, the output projection,
// the second norm, gate/up, SiLU-and-mul, down), chained here in the same order on the same kernels
// (dense, int8, W8A8, int4 or GGUF-block projections, as each layer's method would run them), so the result is the
// same to the bit. What it saves is Python: ~20 torch calls and ~10 module calls
// a layer, then the call a layer itself (most at small batches, where that Python is a large share of
// the step: benchmarks/fused_decode.py). Each projection takes the kernel the caller's plan says (`kinds`).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "ops.h"

namespace {

// How a projection's product runs (the caller's plan for the step's row count).
enum Kind : int64_t {
  TORCH = 0,      // dense weight, torch's GEMM
  NATIVE = 1,     // dense weight, the native kernel (linear.cpp)
  INT8 = 2,       // int8 weight-only (linear_int8.cpp): weight = q, scales [N, K / group]
  W8A8 = 3,       // int8 weights and activations (linear_int8.cpp): weight = q, scales [N], wsums [N]
  INT4PACK = 4,   // torch's CPU int4 kernel: weight = packed, scales = [K / group, N, 2] in bfloat16
  INT4 = 5,       // int4 (linear_int4.cpp): weight = packed [N, K / 2], scales and mins (in wsums) [N, K / group]
  INT8_TILED = 6, // as INT8 and W8A8, 4 weight rows x 4 x rows at a time
  W8A8_TILED = 7,
  W8A8_AMX = 8,   // W8A8 on AMX's int8 tiles
  INT8_AMX = 9,   // int8 and int4 on AMX's bfloat16 tiles
  INT4_AMX = 10,
  GGUF = 11,      // GGUF blocks (gguf_blocks.cpp): weight = the first run's blocks [n0, row bytes], wsums = a
                  // second run's (another block type) or none, scales = int64 [3]: (type 0, type 1, n0)
};

// One projection's tensors and kernel.
struct Projection {
  const at::Tensor& weight;
  const c10::optional<at::Tensor>& bias;
  const c10::optional<at::Tensor>& scales;
  const c10::optional<at::Tensor>& wsums;
  int64_t group;
  int64_t kind;
  int64_t out_features;  // N (int4 weights hold whole tiles of rows: N is not their size)
};

// x [M, in] -> [M, out] by the projection's kernel.
at::Tensor project(const at::Tensor& x, const Projection& p) {
  switch (p.kind) {
    case TORCH: return at::linear(x, p.weight, p.bias);
    case INT4PACK: {
      at::Tensor out = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), p.weight, p.group, *p.scales);
      if (p.bias.has_value()) out = out + p.bias->to(at::kBFloat16);
      return out.to(x.scalar_type());
    }
    default: break;
  }
  at::Tensor out = at::empty({x.size(0), p.out_features}, x.options());
  if (p.kind == NATIVE)
    tokenmill::linear(out, x, p.weight, p.bias);
  else if (p.kind == INT8 || p.kind == INT8_TILED || p.kind == INT8_AMX)
    tokenmill::linear_int8(out, x, p.weight, *p.scales, p.group, p.bias,
                           p.kind == INT8 ? 0 : p.kind == INT8_TILED ? 1 : 2);
  else if (p.kind == W8A8 || p.kind == W8A8_TILED || p.kind == W8A8_AMX)
    tokenmill::linear_w8a8(out, x, p.weight, *p.scales, *p.wsums, p.bias,
                           p.kind == W8A8 ? 0 : p.kind == W8A8_TILED ? 1 : 2);
  else if (p.kind == GGUF) {
    const int64_t* t = p.scales->data_ptr<int64_t>();
    tokenmill::gguf_linear(out.narrow(1, 0, t[2]), x, p.weight, t[0]);
    if (p.wsums.has_value()) tokenmill::gguf_linear(out.narrow(1, t[2], p.out_features - t[2]), x, *p.wsums, t[1]);
    if (p.bias.has_value()) out.add_(*p.bias);
  } else if (p.kind == INT4 || p.kind == INT4_AMX)
    tokenmill::linear_int4(out, x, p.weight, *p.scales, *p.wsums, p.group, p.bias, p.kind == INT4_AMX, false);
  else
    TORCH_CHECK(false, "decode_layer: unknown projection kind ", p.kind);
  return out;
}

// Returns (this layer's MLP output [T, hidden], the residual stream before it [T, hidden]), as
// DecoderLayer.forward does. `residual` None: the first layer (x is the embeddings, kept as the
// residual); otherwise x (the previous MLP output) and residual are updated in place by the add + norm.
// proj: qkv, o, gate_up, down.
std::tuple<at::Tensor, at::Tensor> decode_layer(
    at::Tensor x, const c10::optional<at::Tensor>& residual_in, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const Projection (&proj)[4], int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
    at::Tensor v_cache, const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
    const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_starts, const at::Tensor& query_lens, int64_t block_size, double scale,
    std::optional<int64_t> window) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layer: x must be contiguous [T, hidden]");
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
  const at::Tensor qkv = project(h, proj[0]);  // [T, q + 2 kv]
  // q and k heads side by side: one rotation for both, in place
  const at::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, head_dim});
  tokenmill::rotary(qk, positions, cos, sin);
  const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
  tokenmill::write_kv(k, v, k_cache, v_cache, k_scale, v_scale, slots, block_size);
  at::Tensor attn = at::empty({tokens, num_heads, head_dim}, x.options());
  tokenmill::paged_attention(attn, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_starts, query_lens, block_size,
                             scale, window);
  at::Tensor o = project(attn.view({tokens, q_size}), proj[1]);
  tokenmill::add_rms_norm(o, residual, post_norm, eps);  // residual += o; o = norm(residual)
  const at::Tensor gate_up = project(o, proj[2]);
  at::Tensor act = at::empty({tokens, gate_up.size(1) / 2}, x.options());
  tokenmill::silu_and_mul(act, gate_up);
  return {project(act, proj[3]), residual};
}

// Every decoder layer of the model for one step: decode_layer for layer i with its
// tensors at i (norms: input and post-attention norm of each layer in turn; weights, biases, scales,
// wsums: qkv, o, gate_up, down of each layer; caches: K and V of each layer; cache_scales: their
// scales, for an int8 cache). `kinds` and `groups`: each
// projection's kernel and group size, the same in every layer. Returns as decode_layer does after the
// last layer. What it saves over a call a layer is the Python between them (module attribute lookups
// and the boxing of ~30 arguments, a layer).
std::tuple<at::Tensor, at::Tensor> decode_stack(
    at::Tensor x, at::TensorList norms, at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& biases,
    const c10::List<c10::optional<at::Tensor>>& scales, const c10::List<c10::optional<at::Tensor>>& wsums,
    at::TensorList caches, const c10::List<c10::optional<at::Tensor>>& cache_scales, double eps, c10::List<int64_t> kinds,
    c10::List<int64_t> groups, c10::List<int64_t> out_features, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_starts, const at::Tensor& query_lens, int64_t block_size, double scale,
    const c10::List<c10::optional<int64_t>>& windows) {
  const int64_t layers = static_cast<int64_t>(windows.size());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers && static_cast<int64_t>(caches.size()) == 2 * layers &&
                  static_cast<int64_t>(weights.size()) == 4 * layers && static_cast<int64_t>(biases.size()) == 4 * layers &&
                  static_cast<int64_t>(scales.size()) == 4 * layers && static_cast<int64_t>(wsums.size()) == 4 * layers &&
                  static_cast<int64_t>(cache_scales.size()) == 2 * layers,
              "decode_stack: per layer 2 norms, 4 weights, biases, scales and wsums, 2 caches and a window");
  TORCH_CHECK(kinds.size() == 4 && groups.size() == 4 && out_features.size() == 4,
              "decode_stack: one kind, group and output width per projection");
  c10::optional<at::Tensor> residual;
  at::Tensor h = std::move(x);
  for (int64_t i = 0; i < layers; ++i) {
    const c10::optional<at::Tensor> b[4] = {biases.get(4 * i), biases.get(4 * i + 1), biases.get(4 * i + 2),
                                            biases.get(4 * i + 3)};
    const c10::optional<at::Tensor> s[4] = {scales.get(4 * i), scales.get(4 * i + 1), scales.get(4 * i + 2),
                                            scales.get(4 * i + 3)};
    const c10::optional<at::Tensor> w[4] = {wsums.get(4 * i), wsums.get(4 * i + 1), wsums.get(4 * i + 2),
                                            wsums.get(4 * i + 3)};
    const Projection proj[4] = {
        {weights[4 * i], b[0], s[0], w[0], groups.get(0), kinds.get(0), out_features.get(0)},
        {weights[4 * i + 1], b[1], s[1], w[1], groups.get(1), kinds.get(1), out_features.get(1)},
        {weights[4 * i + 2], b[2], s[2], w[2], groups.get(2), kinds.get(2), out_features.get(2)},
        {weights[4 * i + 3], b[3], s[3], w[3], groups.get(3), kinds.get(3), out_features.get(3)},
    };
    const c10::optional<int64_t> window = windows.get(i);
    auto [out, res] = decode_layer(h, residual, norms[2 * i], norms[2 * i + 1], eps, proj, num_heads, num_kv_heads,
                                   head_dim, positions, cos, sin, caches[2 * i], caches[2 * i + 1],
                                   cache_scales.get(2 * i), cache_scales.get(2 * i + 1), slots,
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
      "decode_stack(Tensor(a!) x, Tensor[] norms, Tensor[] weights, Tensor?[] biases, Tensor?[] scales, "
      "Tensor?[] wsums, Tensor(b!)[] caches, Tensor?[] cache_scales, float eps, int[] kinds, int[] groups, int[] out_features, int num_heads, int num_kv_heads, int head_dim, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor slots, Tensor block_tables, Tensor seq_lens, Tensor query_starts, Tensor query_lens, int block_size, "
      "float scale, int?[] windows) -> (Tensor, Tensor)");
  m.impl("decode_stack", c10::DispatchKey::CPU, &decode_stack);
}

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

#include <cmath>
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

// The model's layers as decode_stack and decode_run take them: per layer i, the input and
// post-attention norms at 2i and 2i + 1; weights, biases, scales, wsums: qkv, o, gate_up, down at 4i..4i+3;
// caches: K and V at 2i and 2i + 1 (cache_scales: theirs, for an int8 cache); each projection's kernel,
// group size and output width the same in every layer.
struct Stack {
  at::TensorList norms, weights;
  const c10::List<c10::optional<at::Tensor>>& biases;
  const c10::List<c10::optional<at::Tensor>>& scales;
  const c10::List<c10::optional<at::Tensor>>& wsums;
  at::TensorList caches;
  const c10::List<c10::optional<at::Tensor>>& cache_scales;
  double eps;
  const c10::List<int64_t>& kinds;
  const c10::List<int64_t>& groups;
  const c10::List<int64_t>& out_features;
  int64_t num_heads, num_kv_heads, head_dim;
  const at::Tensor& cos;
  const at::Tensor& sin;
  int64_t block_size;
  double scale;
  const c10::List<c10::optional<int64_t>>& windows;

  int64_t layers() const { return static_cast<int64_t>(windows.size()); }

  void check() const {
    const int64_t n = layers();
    TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * n && static_cast<int64_t>(caches.size()) == 2 * n &&
                    static_cast<int64_t>(weights.size()) == 4 * n && static_cast<int64_t>(biases.size()) == 4 * n &&
                    static_cast<int64_t>(scales.size()) == 4 * n && static_cast<int64_t>(wsums.size()) == 4 * n &&
                    static_cast<int64_t>(cache_scales.size()) == 2 * n,
                "decode_stack: per layer 2 norms, 4 weights, biases, scales and wsums, 2 caches and a window");
    TORCH_CHECK(kinds.size() == 4 && groups.size() == 4 && out_features.size() == 4,
                "decode_stack: one kind, group and output width per projection");
    TORCH_CHECK(n > 0, "decode_stack: no layers");
  }
};

// The step's attention metadata (CpuMetadata's tensors).
struct StepInputs {
  const at::Tensor& positions;
  const at::Tensor& slots;
  const at::Tensor& block_tables;
  const at::Tensor& seq_lens;
  const at::Tensor& query_starts;
  const at::Tensor& query_lens;
};

// Every layer of `st` over x [T, hidden]: (the last layer's MLP output, the residual), as decode_layer returns.
std::tuple<at::Tensor, at::Tensor> run_layers(at::Tensor x, const Stack& st, const StepInputs& in) {
  c10::optional<at::Tensor> residual;
  at::Tensor h = std::move(x);
  for (int64_t i = 0; i < st.layers(); ++i) {
    const c10::optional<at::Tensor> b[4] = {st.biases.get(4 * i), st.biases.get(4 * i + 1), st.biases.get(4 * i + 2),
                                            st.biases.get(4 * i + 3)};
    const c10::optional<at::Tensor> s[4] = {st.scales.get(4 * i), st.scales.get(4 * i + 1), st.scales.get(4 * i + 2),
                                            st.scales.get(4 * i + 3)};
    const c10::optional<at::Tensor> w[4] = {st.wsums.get(4 * i), st.wsums.get(4 * i + 1), st.wsums.get(4 * i + 2),
                                            st.wsums.get(4 * i + 3)};
    Projection proj[4] = {
        {st.weights[4 * i], b[0], s[0], w[0], st.groups.get(0), st.kinds.get(0), st.out_features.get(0)},
        {st.weights[4 * i + 1], b[1], s[1], w[1], st.groups.get(1), st.kinds.get(1), st.out_features.get(1)},
        {st.weights[4 * i + 2], b[2], s[2], w[2], st.groups.get(2), st.kinds.get(2), st.out_features.get(2)},
        {st.weights[4 * i + 3], b[3], s[3], w[3], st.groups.get(3), st.kinds.get(3), st.out_features.get(3)},
    };
    const c10::optional<int64_t> window = st.windows.get(i);
    auto [out, res] = decode_layer(
        h, residual, st.norms[2 * i], st.norms[2 * i + 1], st.eps, proj, st.num_heads, st.num_kv_heads, st.head_dim,
        in.positions, st.cos, st.sin, st.caches[2 * i], st.caches[2 * i + 1], st.cache_scales.get(2 * i),
        st.cache_scales.get(2 * i + 1), in.slots, in.block_tables, in.seq_lens, in.query_starts, in.query_lens,
        st.block_size, st.scale, window.has_value() ? std::optional<int64_t>(*window) : std::nullopt);
    h = std::move(out);
    residual = std::move(res);
  }
  return {h, *residual};
}

// Every decoder layer of the model for one step (Stack says how the lists hold them). Returns as
// decode_layer does after the last layer. What it saves over a call a layer is the Python between them
// (module attribute lookups and the boxing of ~30 arguments, a layer).
std::tuple<at::Tensor, at::Tensor> decode_stack(
    at::Tensor x, at::TensorList norms, at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& biases,
    const c10::List<c10::optional<at::Tensor>>& scales, const c10::List<c10::optional<at::Tensor>>& wsums,
    at::TensorList caches, const c10::List<c10::optional<at::Tensor>>& cache_scales, double eps, c10::List<int64_t> kinds,
    c10::List<int64_t> groups, c10::List<int64_t> out_features, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slots, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_starts, const at::Tensor& query_lens, int64_t block_size, double scale,
    const c10::List<c10::optional<int64_t>>& windows) {
  const Stack st{norms, weights, biases, scales, wsums, caches, cache_scales, eps, kinds, groups, out_features,
                 num_heads, num_kv_heads, head_dim, cos, sin, block_size, scale, windows};
  st.check();
  return run_layers(std::move(x), st, {positions, slots, block_tables, seq_lens, query_starts, query_lens});
}

// decode_run's embed_type where it is not a GGML block type (layers/fused_decode.py names them alike)
constexpr int64_t EMBED_DENSE = -1, EMBED_INT8_HEAD = -2, EMBED_INT4_HEAD = -3;

// Rows `ids` [B] of an int8 head [V, K] (q, scales [V, K / group] or [V] with group K) -> [B, K] in `dtype`
at::Tensor int8_head_rows(const at::Tensor& q, const Projection& head, const at::Tensor& ids, at::ScalarType dtype) {
  TORCH_CHECK(q.scalar_type() == at::kChar && head.scales.has_value() && head.group > 0 &&
                  q.size(1) % head.group == 0, "decode_run: embed_type -2 takes the head's int8 weights and scales");
  const int64_t K = q.size(1);
  const at::Tensor scales = head.scales->view({q.size(0), K / head.group});  // float32
  const at::Tensor rows = q.index_select(0, ids).to(at::kFloat).view({-1, K / head.group, head.group});
  return (rows * scales.index_select(0, ids).unsqueeze(-1)).view({-1, K}).to(dtype);
}

// Rows `ids` [B] of an int4 head in tiles (packed [T, K / 8, 64]: chunk c of tile t holds row 16t + i's
// k = 8c + j in byte 4i + j's low nibble, 8c + 4 + j in its high one; scales, mins [T, K / group, 16])
at::Tensor int4_head_rows(const at::Tensor& packed, const Projection& head, const at::Tensor& ids, at::ScalarType dtype) {
  using at::indexing::Slice;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == 64 &&
                  head.scales.has_value() && head.wsums.has_value() && head.group > 0,
              "decode_run: embed_type -3 takes the head's int4 tiles, scales and mins");
  const int64_t K = packed.size(1) * 8, tile = 16;
  const at::Tensor tiles = at::floor_divide(ids, tile), lanes = at::remainder(ids, tile);
  const at::Tensor bytes = packed.view({packed.size(0), K / 8, tile, 4}).index({tiles, Slice(), lanes}).to(at::kInt);
  const at::Tensor q = at::cat({at::bitwise_and(bytes, 15), at::bitwise_right_shift(bytes, 4)}, -1);  // [B, K / 8, 8]
  const at::Tensor scales = head.scales->index({tiles, Slice(), lanes}).to(at::kFloat).unsqueeze(-1);
  const at::Tensor mins = head.wsums->index({tiles, Slice(), lanes}).to(at::kFloat).unsqueeze(-1);
  const at::Tensor rows = q.to(at::kFloat).view({-1, K / head.group, head.group});
  return (rows * scales + mins).view({-1, K}).to(dtype);
}

// `steps` greedy decode steps in a row of B sequences (runner/multi_step.py), each step as the modules run
// it: the embedding rows of the step's tokens, the layers, the final norm (with the residual add), the
// output projection (`head`: its kernel `head_kind`), float32 logits and their argmax (argmax_rows); the
// argmax is the next step's token. `embed`: a dense table [V, hidden] (embed_type -1), a GGUF file's
// blocks [V, row bytes] of GGML type `embed_type` (gguf_dequant: each step's rows dequantized), or a tied
// head's own weights, `head` itself, each row dequantized in float32 and rounded to the model's dtype as
// quant/quantize.py reads them: (-2) int8 [V, hidden], q times its head_scales (a scale a head_group);
// (-3) int4 in tiles of 16 rows, q times its scale plus its min (head_wsums). ids [B]
// int64: each sequence's first token; starts [B] int64: its position; block_tables [B, W] int32: each
// sequence's blocks, covering starts + steps tokens. Writes each step's K and V into the caches. Returns tokens [B, steps] int64, -1 where a row's logit at its
// argmax was NaN (its later tokens follow from a NaN: the caller fails the request).
at::Tensor decode_run(
    const at::Tensor& ids, const at::Tensor& starts, const at::Tensor& embed, int64_t embed_type,
    const at::Tensor& final_norm,
    const at::Tensor& head, const c10::optional<at::Tensor>& head_bias, const c10::optional<at::Tensor>& head_scales,
    const c10::optional<at::Tensor>& head_wsums, int64_t head_group, int64_t head_kind, int64_t head_out, int64_t steps,
    at::TensorList norms, at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& biases,
    const c10::List<c10::optional<at::Tensor>>& scales, const c10::List<c10::optional<at::Tensor>>& wsums,
    at::TensorList caches, const c10::List<c10::optional<at::Tensor>>& cache_scales, double eps, c10::List<int64_t> kinds,
    c10::List<int64_t> groups, c10::List<int64_t> out_features, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& block_tables, int64_t block_size,
    double scale, const c10::List<c10::optional<int64_t>>& windows) {
  const Stack st{norms, weights, biases, scales, wsums, caches, cache_scales, eps, kinds, groups, out_features,
                 num_heads, num_kv_heads, head_dim, cos, sin, block_size, scale, windows};
  st.check();
  const int64_t batch = ids.size(0);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && starts.sizes() == ids.sizes() &&
                  starts.scalar_type() == at::kLong, "decode_run: ids and starts must be int64 [B]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch && block_tables.scalar_type() == at::kInt &&
                  block_tables.is_contiguous(), "decode_run: block_tables must be contiguous int32 [B, W]");
  TORCH_CHECK((embed.dim() == 2 || embed_type == EMBED_INT4_HEAD) && embed.is_contiguous() && steps >= 1,
              "decode_run: embed must be [V, hidden]");
  TORCH_CHECK((embed_type != EMBED_INT8_HEAD && embed_type != EMBED_INT4_HEAD) || embed.is_same(head),
              "decode_run: embed_type -2 and -3 read the head's own rows");
  TORCH_CHECK(embed_type >= EMBED_INT4_HEAD, "decode_run: unknown embed_type ", embed_type);
  const int64_t width = block_tables.size(1);
  const auto i64 = ids.options(), i32 = ids.options().dtype(at::kInt);
  at::Tensor tokens = at::empty({batch, steps}, i64);
  at::Tensor positions = starts.clone(), input = ids.clone();
  at::Tensor slots = at::empty({batch}, i64), seq_lens = at::empty({batch}, i32);
  const at::Tensor query_starts = at::arange(batch, i32), query_lens = at::ones({batch}, i32);
  const Projection head_proj{head, head_bias, head_scales, head_wsums, head_group, head_kind, head_out};
  const int32_t* table = block_tables.data_ptr<int32_t>();
  int64_t* slot = slots.data_ptr<int64_t>();
  int32_t* length = seq_lens.data_ptr<int32_t>();
  int64_t* picked = tokens.data_ptr<int64_t>();
  int64_t* next = input.data_ptr<int64_t>();
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {  // this step's slot and length of each sequence
      const int64_t p = pos[b];
      TORCH_CHECK(p >= 0 && p / block_size < width, "decode_run: the block tables do not cover the run");
      slot[b] = static_cast<int64_t>(table[b * width + p / block_size]) * block_size + p % block_size;
      length[b] = static_cast<int32_t>(p + 1);
    }
    at::Tensor x;  // [B, hidden]: this step's embeddings
    if (embed_type == EMBED_DENSE) {
      x = embed.index_select(0, input);
    } else if (embed_type == EMBED_INT8_HEAD) {
      x = int8_head_rows(embed, head_proj, input, final_norm.scalar_type());
    } else if (embed_type == EMBED_INT4_HEAD) {
      x = int4_head_rows(embed, head_proj, input, final_norm.scalar_type());
    } else {
      x = at::empty({batch, final_norm.size(0)}, final_norm.options());
      tokenmill::gguf_dequant(x, embed, embed_type, input, 0);
    }
    auto [out, residual] = run_layers(x, st, {positions, slots, block_tables, seq_lens, query_starts, query_lens});
    // out = norm(out + residual), as the model's norm.add (the Llama family's norms share one epsilon)
    tokenmill::add_rms_norm(out, residual, final_norm, eps);
    const at::Tensor logits = project(out, head_proj).to(at::kFloat).contiguous();  // [B, vocab]
    at::Tensor argmax = at::empty({batch}, i64);
    tokenmill::argmax_rows(argmax, logits);
    const int64_t* am = argmax.data_ptr<int64_t>();
    const float* lp = logits.data_ptr<float>();
    for (int64_t b = 0; b < batch; ++b) {
      const bool nan = std::isnan(lp[b * logits.size(1) + am[b]]);
      picked[b * steps + s] = nan ? -1 : am[b];
      next[b] = nan ? 0 : am[b];  // (a NaN row's request fails: its next input may be any token)
    }
    positions.add_(1);
  }
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def(
      "decode_stack(Tensor(a!) x, Tensor[] norms, Tensor[] weights, Tensor?[] biases, Tensor?[] scales, "
      "Tensor?[] wsums, Tensor(b!)[] caches, Tensor?[] cache_scales, float eps, int[] kinds, int[] groups, int[] out_features, int num_heads, int num_kv_heads, int head_dim, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor slots, Tensor block_tables, Tensor seq_lens, Tensor query_starts, Tensor query_lens, int block_size, "
      "float scale, int?[] windows) -> (Tensor, Tensor)");
  m.impl("decode_stack", c10::DispatchKey::CPU, &decode_stack);
  m.def(
      "decode_run(Tensor ids, Tensor starts, Tensor embed, int embed_type, Tensor final_norm, Tensor head, Tensor? head_bias, "
      "Tensor? head_scales, Tensor? head_wsums, int head_group, int head_kind, int head_out, int steps, Tensor[] norms, "
      "Tensor[] weights, Tensor?[] biases, Tensor?[] scales, Tensor?[] wsums, Tensor(b!)[] caches, "
      "Tensor?[] cache_scales, float eps, int[] kinds, int[] groups, int[] out_features, int num_heads, "
      "int num_kv_heads, int head_dim, Tensor cos, Tensor sin, Tensor block_tables, int block_size, float scale, "
      "int?[] windows) -> Tensor");
  m.impl("decode_run", c10::DispatchKey::CPU, &decode_run);
}

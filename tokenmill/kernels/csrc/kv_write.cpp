// The paged KV cache's write: each new token's K and V rows into their (block, KV head) chunks, in
// attention.cpp's layout (K's chunk [head_dim, block_size], V's [block_size, head_dim]); an int8
// cache's rows quantized on the way, one float32 scale a token and head (max |x| / 127).
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ops.h"

namespace {

// One token's K or V of one head quantized to int8: dst[i * step] = round(src[i] / scale), scale =
// max |src| / 127 (0 for a row of zeros), returned.
template <typename T>
float quantize_row(const T* src, int64_t dim, int8_t* dst, int64_t step) {
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(static_cast<float>(src[d])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t d = 0; d < dim; ++d) dst[d * step] = static_cast<int8_t>(std::nearbyint(static_cast<float>(src[d]) * inv));
  return amax / 127.f;
}

template <typename T>
void write_int8(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache, float* k_scales,
                float* v_scales, const at::Tensor& slots, int64_t block_size) {
  const int64_t n = slots.size(0), kv_heads = k.size(1), dim = k.size(2), chunk = block_size * dim;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  int8_t* kc = k_cache.data_ptr<int8_t>();
  int8_t* vc = v_cache.data_ptr<int8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t block = sp[i] / block_size, t = sp[i] % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t at = (block * kv_heads + h);
      k_scales[at * block_size + t] =
          quantize_row(kp + i * k.stride(0) + h * k.stride(1), dim, kc + at * chunk + t, block_size);
      v_scales[at * block_size + t] = quantize_row(vp + i * v.stride(0) + h * v.stride(1), dim, vc + at * chunk + t * dim, 1);
    }
  }
}

template <typename T>
void write(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
           const at::Tensor& slots, int64_t block_size) {
  const int64_t n = slots.size(0), kv_heads = k.size(1), dim = k.size(2), chunk = block_size * dim;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t block = sp[i] / block_size, t = sp[i] % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const T* src_k = kp + i * k.stride(0) + h * k.stride(1);
      T* dst_k = kc + (block * kv_heads + h) * chunk + t;  // column t of [dim, block_size]
      for (int64_t d = 0; d < dim; ++d) dst_k[d * block_size] = src_k[d];
      std::memcpy(vc + (block * kv_heads + h) * chunk + t * dim, vp + i * v.stride(0) + h * v.stride(1),
                  dim * sizeof(T));  // row t of [block_size, dim]
    }
  }
}

}  // namespace

namespace tokenmill {

// The first slots.size(0) rows of k and v [T, kv_heads, D] (the last dim contiguous) into the
// caches at flat slots (block_id * block_size + offset), int64.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
              const at::Tensor& slots, int64_t block_size) {
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k.sizes() == v.sizes(),
              "k and v must be [T, kv_heads, D]");
  check_kv_cache(k_cache, v_cache, block_size, k.size(2), k_scale, v_scale);
  TORCH_CHECK(k.size(1) == k_cache.size(1), "k does not match the cache's KV heads");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && (int8 || k.scalar_type() == k_cache.scalar_type()),
              "k, v and the caches must share a dtype (or the caches be int8)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) <= k.size(0),
              "slots must be int64, one per real token");
  if (int8) {
    float* ks = k_scale->data_ptr<float>();
    float* vs = v_scale->data_ptr<float>();
    if (k.scalar_type() == at::kFloat)
      write_int8<float>(k, v, k_cache, v_cache, ks, vs, slots, block_size);
    else if (k.scalar_type() == at::kBFloat16)
      write_int8<c10::BFloat16>(k, v, k_cache, v_cache, ks, vs, slots, block_size);
    else
      TORCH_CHECK(false, "write_kv: float32 and bfloat16 only");
  } else if (k.scalar_type() == at::kFloat) {
    write<float>(k, v, k_cache, v_cache, slots, block_size);
  } else if (k.scalar_type() == at::kBFloat16) {
    write<c10::BFloat16>(k, v, k_cache, v_cache, slots, block_size);
  } else {
    TORCH_CHECK(false, "write_kv: float32 and bfloat16 only");
  }
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def(
      "write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!)? k_scale, Tensor(d!)? v_scale, "
      "Tensor slots, int block_size) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, &tokenmill::write_kv);
}

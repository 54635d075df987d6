// Quantized weights written out dense, for a prompt chunk's dequantize-then-GEMM: int8 [N, K] with
// float32 scales per group, and tokenmill's int4 tiles (linear_int4.cpp's layout) with float16 or
// float32 scales and mins, into float32 or bfloat16 rows [N, K]. The values are those
// quant/quantize.py's `dequantize_int8` / `dequantize_int4` compute (float32 q * scale, int4's min
// added after, then rounded as torch rounds to bfloat16), bit for bit; this writes them in one pass a
// row, every thread a range of rows, where the torch expressions make three passes over float32
// copies of the whole matrix.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "convert.h"

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t TILE = 16;  // int4: weight rows a tile
constexpr int64_t CHUNK_BYTES = 64;  // int4: a tile's 8 k

// out rows [begin, end) of int8 q [N, K] * scales [N, K / group]
template <typename T>
void int8_rows(T* out, const int8_t* q, const float* scales, int64_t K, int64_t group, int64_t begin, int64_t end) {
  std::vector<float> row(K);
  const int64_t G = K / group;
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* qr = q + n * K;
    for (int64_t g = 0; g < G; ++g) {
      const float s = scales[n * G + g];
      float* r = row.data() + g * group;
#pragma omp simd
      for (int64_t i = 0; i < group; ++i) r[i] = static_cast<float>(qr[g * group + i]) * s;
    }
    from_float_row(row.data(), out + n * K, K);
  }
}

inline float widen(const at::Half* h, const float* f, int64_t i) { return f ? f[i] : static_cast<float>(h[i]); }

// out rows [16 t0, 16 t1) (clipped to N) of int4 tiles: W[n, k] = q * scale + min
template <typename T>
void int4_tiles(T* out, const uint8_t* packed, const at::Half* s16, const float* s32, const at::Half* m16,
                const float* m32, int64_t N, int64_t K, int64_t group, int64_t t0, int64_t t1) {
  const int64_t G = K / group, chunks = K / 8;
  std::vector<float> row(K);
  std::vector<float> scale(G), low(G);
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = packed + t * chunks * CHUNK_BYTES;
    for (int64_t i = 0; i < TILE && t * TILE + i < N; ++i) {
      for (int64_t g = 0; g < G; ++g) {
        scale[g] = widen(s16, s32, (t * G + g) * TILE + i);
        low[g] = widen(m16, m32, (t * G + g) * TILE + i);
      }
      for (int64_t c = 0; c < chunks; ++c) {
        const uint8_t* b = tile + c * CHUNK_BYTES + 4 * i;
        const int64_t g = (8 * c) / group;
        float* r = row.data() + 8 * c;
        for (int j = 0; j < 4; ++j) {
          // (a product, then a sum: the same two roundings as the torch expression, no fused multiply-add)
          const float lo = static_cast<float>(b[j] & 15) * scale[g], hi = static_cast<float>(b[j] >> 4) * scale[g];
          r[j] = lo + low[g];
          r[4 + j] = hi + low[g];
        }
      }
      from_float_row(row.data(), out + (t * TILE + i) * K, K);
    }
  }
}

void check_out(const at::Tensor& out, int64_t N, int64_t K, const char* name) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == N && out.size(1) == K, name,
              ": out must be contiguous [N, K]");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, name,
              ": out float32 or bfloat16");
}

}  // namespace

namespace tokenmill {

// out [N, K] = q [N, K] (int8) * scales [N, K / group] (float32), a scale per group of k
void dequant_int8(at::Tensor out, const at::Tensor& q, const at::Tensor& scales, int64_t group) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar, "dequant_int8: q must be contiguous int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(group > 0 && K % group == 0, "dequant_int8: group must divide K");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.numel() == N * (K / group),
              "dequant_int8: scales must be contiguous float32 [N, K / group]");
  check_out(out, N, K, "dequant_int8");
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    if (out.scalar_type() == at::kFloat)
      int8_rows(out.data_ptr<float>(), qp, sp, K, group, begin, end);
    else
      int8_rows(out.data_ptr<bf16>(), qp, sp, K, group, begin, end);
  });
}

// out [N, K] from int4 tiles: packed [ceil(N / 16), K / 8, 64] (uint8), scales and mins
// [ceil(N / 16), K / group, 16] (each float16 or float32)
void dequant_int4(at::Tensor out, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins,
                  int64_t group) {
  const int64_t N = out.size(0), K = out.size(1), tiles = (N + TILE - 1) / TILE;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.size(0) == tiles && packed.size(1) * 8 == K && packed.size(2) == CHUNK_BYTES,
              "dequant_int4: packed must be contiguous uint8 [ceil(N / 16), K / 8, 64]");
  TORCH_CHECK(group >= 8 && group % 8 == 0 && K % group == 0, "dequant_int4: group a multiple of 8 dividing K");
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->is_contiguous() && t->numel() == tiles * (K / group) * TILE &&
                    (t->scalar_type() == at::kHalf || t->scalar_type() == at::kFloat),
                "dequant_int4: scales and mins must be contiguous float16 or float32 [ceil(N / 16), K / group, 16]");
  check_out(out, N, K, "dequant_int4");
  const bool s32 = scales.scalar_type() == at::kFloat, m32 = mins.scalar_type() == at::kFloat;
  const at::Half* sh = s32 ? nullptr : scales.data_ptr<at::Half>();
  const float* sf = s32 ? scales.data_ptr<float>() : nullptr;
  const at::Half* mh = m32 ? nullptr : mins.data_ptr<at::Half>();
  const float* mf = m32 ? mins.data_ptr<float>() : nullptr;
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    if (out.scalar_type() == at::kFloat)
      int4_tiles(out.data_ptr<float>(), pp, sh, sf, mh, mf, N, K, group, begin, end);
    else
      int4_tiles(out.data_ptr<bf16>(), pp, sh, sf, mh, mf, N, K, group, begin, end);
  });
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("dequant_int8(Tensor(a!) out, Tensor q, Tensor scales, int group) -> ()");
  m.impl("dequant_int8", c10::DispatchKey::CPU, &tokenmill::dequant_int8);
  m.def("dequant_int4(Tensor(a!) out, Tensor packed, Tensor scales, Tensor mins, int group) -> ()");
  m.impl("dequant_int4", c10::DispatchKey::CPU, &tokenmill::dequant_int4);
}

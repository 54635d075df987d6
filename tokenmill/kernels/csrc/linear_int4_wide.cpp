// int4 products for many rows (prompt chunks, batches past the decode class) with the activations kept
// in float: y [M, N] = x [M, K] @ W^T (+ bias), W in linear_int4.cpp's tiles of 16 rows (a tile's chunk
// c, 64 bytes, holds row i's k = 8c + j in byte 4i + j's low nibble and 8c + 4 + j in its high one;
// scales and mins [tile, group, 16], float16 or float32; W = q * scale + min).
//
// On AVX2 without AVX-512, linear_broadcast.h's float32 outer-product tiles run the product: each tile
// of 6 weight rows is dequantized into the thread's scratch once for all the x panels, so no dense copy
// of the layer is written (the cost `dequant32` pays every product: a float32 copy of the weights) and
// the prompt's activations are not rounded to int8 (linear_int4.cpp's integer kernel rounds them, which
// is kept to decode rows). Rows past the last whole tile of 6, and every row where those tiles are not
// built, take a plain loop: each weight row dequantized once, dotted with every x row in float32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "linear_broadcast.h"

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t TILE = 16;         // weight rows a packed tile
constexpr int64_t CHUNK_BYTES = 64;  // a packed tile's 8 k

inline float half_bits(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// Where a packed weight lives: its tiles, and their scales and mins in either float16 or float32.
struct Int4View {
  const uint8_t* packed;  // [tiles, K / 8, 64]
  const uint16_t* s16;    // [tiles, G, 16] float16 bits, or
  const float* s32;       // in float32
  const uint16_t* m16;
  const float* m32;
  int64_t K;
  int64_t G;
  int shift;  // log2(group)

  float scale(int64_t t, int64_t g, int64_t i) const {
    const int64_t at = (t * G + g) * TILE + i;
    return s32 ? s32[at] : half_bits(s16[at]);
  }
  float min(int64_t t, int64_t g, int64_t i) const {
    const int64_t at = (t * G + g) * TILE + i;
    return m32 ? m32[at] : half_bits(m16[at]);
  }

  // weight row n dequantized into dst [K] (float32)
  void row(int64_t n, float* dst) const {
    const int64_t t = n / TILE, i = n % TILE, per_group = (int64_t{1} << shift) / 8;
    const uint8_t* base = packed + t * K * 8 + 4 * i;
    for (int64_t g = 0; g < G; ++g) {
      const float s = scale(t, g, i), mn = min(t, g, i);
      for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
        uint32_t v;
        std::memcpy(&v, base + c * CHUNK_BYTES, 4);
#if defined(__AVX2__) && defined(__FMA__)
        const __m128i b = _mm_cvtsi32_si128(static_cast<int>(v)), low = _mm_set1_epi8(0x0F);
        // bytes 0-3: the low nibbles (k 8c .. 8c + 3), bytes 4-7: the high ones (8c + 4 .. 8c + 7)
        const __m128i q = _mm_unpacklo_epi32(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
        _mm256_storeu_ps(dst + c * 8, _mm256_fmadd_ps(f, _mm256_set1_ps(s), _mm256_set1_ps(mn)));
#else
        for (int j = 0; j < 4; ++j) {
          const uint32_t byte = (v >> (8 * j)) & 0xFF;
          dst[c * 8 + j] = static_cast<float>(byte & 15) * s + mn;
          dst[c * 8 + 4 + j] = static_cast<float>(byte >> 4) * s + mn;
        }
#endif
      }
    }
  }
};

// y[:, n0:N] for x in float32 [M, K] (row stride x_row): each weight row dequantized once, dotted with
// every x row.
template <typename T>
void rows_plain(const Int4View& w, const float* x, int64_t x_row, int64_t M, int64_t n0, int64_t N, const T* bias,
                T* y, int64_t y_row) {
  const int64_t K = w.K;
  at::parallel_for(n0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t n = begin; n < end; ++n) {
      w.row(n, row.data());
      const float b = bias ? static_cast<float>(bias[n]) : 0.f;
      for (int64_t m = 0; m < M; ++m) {
        const float* xm = x + m * x_row;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t k = 0; k < K; ++k) sum += xm[k] * row[k];
        y[m * y_row + n] = from_float<T>(sum + b);
      }
    }
  });
}

template <typename T>
void wide_impl(at::Tensor& out, const at::Tensor& x, const Int4View& w, const T* bias) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  std::vector<float> widened;
  int64_t x_row = x.stride(0);
  const float* xf = tm_panels::float_rows(x.data_ptr<T>(), x_row, M, K, widened);
  T* y = out.data_ptr<T>();
  int64_t done = 0;
#if defined(TM_BROADCAST_TILES)
  const auto rows_of = [&](int64_t n0, float* scratch) -> const float* {
    for (int r = 0; r < tm_broadcast::NR; ++r) w.row(n0 + r, scratch + r * K);
    return scratch;
  };
  done = tm_broadcast::linear_tiles<false>(xf, x_row, M, N, K, rows_of, bias, y, out.stride(0));
#endif
  if (done < N) rows_plain(w, xf, x_row, M, done, N, bias, y, out.stride(0));
}

}  // namespace

namespace tokenmill {

// out [M, N] = x [M, K] @ W^T (+ bias), W as linear_int4's packed [ceil(N / 16), K / 8, 64] with scales
// and mins [ceil(N / 16), K / group, 16] (float16 or float32), x and out float32 or bfloat16.
void linear_int4_wide(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                      const at::Tensor& mins, int64_t group, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_int4_wide: x must be [M, K] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0),
              "linear_int4_wide: out must be [M, N] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), tiles = (N + TILE - 1) / TILE;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.size(0) == tiles && packed.size(1) * 8 == K && packed.size(2) == CHUNK_BYTES && K % 32 == 0,
              "linear_int4_wide: packed must be contiguous uint8 [ceil(N / 16), K / 8, 64] for x [M, K] and out "
              "[M, N], K a multiple of 32");
  TORCH_CHECK(group >= 32 && group <= 4096 && (group & (group - 1)) == 0 && K % group == 0,
              "linear_int4_wide: group must be a power of two from 32 to 4096 dividing K, got ", group);
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf || t->scalar_type() == at::kFloat,
                "linear_int4_wide: scales and mins must be float16 or float32");
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous() && t->size(0) == tiles && t->size(1) == K / group &&
                    t->size(2) == TILE,
                "linear_int4_wide: scales and mins must be contiguous [ceil(N / 16), K / group, 16]");
  }
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  out.scalar_type() == x.scalar_type(),
              "linear_int4_wide: x and out float32 or bfloat16, one dtype");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                                     bias->numel() == N),
              "linear_int4_wide: bias must be contiguous [N] in x's dtype");
  if (M == 0 || N == 0) return;
  const bool s32 = scales.scalar_type() == at::kFloat, m32 = mins.scalar_type() == at::kFloat;
  const Int4View w{packed.data_ptr<uint8_t>(),
                   s32 ? nullptr : reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                   s32 ? scales.data_ptr<float>() : nullptr,
                   m32 ? nullptr : reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()),
                   m32 ? mins.data_ptr<float>() : nullptr,
                   K,
                   K / group,
                   std::countr_zero(static_cast<uint64_t>(group))};
  if (x.scalar_type() == at::kFloat)
    wide_impl<float>(out, x, w, bias ? bias->data_ptr<float>() : nullptr);
  else
    wide_impl<bf16>(out, x, w, bias ? bias->data_ptr<bf16>() : nullptr);
}

// Whether linear_broadcast.h's outer-product tiles are built here (AVX2 without AVX-512): elsewhere
// linear_int4_wide runs its plain loop alone.
bool broadcast_tiles_built() {
#if defined(TM_BROADCAST_TILES)
  return true;
#else
  return false;
#endif
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def(
      "linear_int4_wide(Tensor(a!) out, Tensor x, Tensor packed, Tensor scales, Tensor mins, int group, Tensor? "
      "bias) -> ()");
  m.impl("linear_int4_wide", c10::DispatchKey::CPU, &tokenmill::linear_int4_wide);
  m.def("broadcast_tiles_built() -> bool", &tokenmill::broadcast_tiles_built);
}

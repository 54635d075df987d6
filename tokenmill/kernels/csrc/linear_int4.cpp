// Linear layers with int4 weights on the CPU, for decode batches (few x rows): y [M, N] = x [M, K] @
// W^T (+ bias), W in asymmetric groups: W[n, k] = q[n, k] * scales[n, g] + mins[n, g], g = k / group,
// q in 0..15, scales and mins float16 (the grid GGUF's Q4_1 stores) or float32 (checkpoints' scales that
// float16 would round, AWQ's and GPTQ's -zero * scale: exact there).
//
// Layout (tokenmill's own, layers/quantize.py `Int4Weight`): rows in tiles of 16; a tile's chunk c
// (k 8c .. 8c + 7) is 64 bytes, byte 4i + j holding row i's k = 8c + j in its low nibble and 8c + 4 + j
// in its high one; scales and mins [tile, group, 16]. One 64-byte load is then 4 consecutive k of 16
// rows in each nibble half, so an integer dot-product lane is a weight row: vpdpbusd multiplies it by 4
// bytes of x broadcast to every lane, the sums of a run of 32 k stay in int32 lanes, and one scale
// vector (16 rows' scales for the run's group, one load) turns them into float. Nothing is reduced
// across lanes and a tile's 16 outputs are one vector. The row-major layout before it (a row's 128 k a
// load, each run's scale moved to its lanes by a permute, 16 rows' partial sums reduced at the end)
// needed 2.5 vector instructions a row and run against 1.5 here, and was arithmetic-bound: a row took
// as long whether its weights came from L2 or memory.
//
// x rows are quantized to int8 in runs of 32 k, one float scale a run (llama.cpp's Q8_0 activations);
// the mins' share, min * sum(x over the run), takes the runs' float sums of x, made once per call.
// Up to 8 x rows a tile pass; each thread a contiguous range of tiles; group a power of two from 32
// dividing K.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "convert.h"
#include "int_dot.h"
#include "linear_amx.h"

namespace {

using namespace tm_int;
using bf16 = c10::BFloat16;
constexpr int64_t MAX_ROWS = 8;
constexpr int64_t RUN = 32;   // k per x scale
constexpr int64_t TILE = 16;  // weight rows a tile
constexpr int64_t CHUNK_BYTES = 64;  // a tile's 8 k

// x [M, K] -> xq [M, K] int8 (each run of 32 symmetric with its own scale), xs [M, K / 32] the runs'
// scales times `unit` (the value of one step of the sums the kernel forms), xsum [M, K / 32] their
// float sums.
template <typename T>
void quantize_runs(const T* x, int64_t x_row, int64_t M, int64_t K, float unit, int8_t* xq, float* xs, float* xsum) {
  const int64_t R = K / RUN;
  float v[RUN];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r) {
      to_float(x + m * x_row + r * RUN, v, RUN);
      int8_t* q = xq + m * K + r * RUN;
#if defined(__AVX512F__)
      // (vectorized: at one row the scalar loop cost a sizeable share of the layer's product)
      const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);  // rounded to nearest even
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv))));
      xsum[m * R + r] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
#else
      float amax = 0.f, sum = 0.f;
      for (int i = 0; i < RUN; ++i) amax = std::max(amax, std::fabs(v[i])), sum += v[i];
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int i = 0; i < RUN; ++i) q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
      xsum[m * R + r] = sum;
#endif
      xs[m * R + r] = amax / 127.f * unit;
    }
}

inline float half_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// A tile's weights and the x rows against it.
struct TileArgs {
  const uint8_t* p;   // the tile's chunks [K / 8][64]
  const uint16_t* s;  // its scales [G][16] (float16 bits), or
  const float* s32;   // in float32
  const uint16_t* mn; // its mins [G][16] (float16), or
  const float* mn32;  // in float32
  int runs_a_group;   // group / 32
  int64_t K;
  const int8_t* xq;   // x rows [MM, K]
  const float* xs;    // [MM, R]
  const float* xsum;  // [MM, R]
};

inline int32_t x4(const int8_t* p) {  // 4 bytes of x as one lane's operand
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TM_INT4_512 1
// With VNNI the high nibbles are multiplied where they sit (byte & 0xF0: 16 times the value; vpdpbusd
// sums its products in int32 without saturating) and the two halves' sums joined as 16 lo + hi: the
// sums are 16 times the products, which xs's unit (1/16) undoes. Without it vpmaddubsw's int16 pair
// sums would saturate: the high nibbles are shifted down.
#if defined(__AVX512VNNI__)
constexpr bool HIGH_IN_PLACE = true;
inline __m512i dot(__m512i acc, __m512i u, int32_t s) { return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(s)); }
#else
constexpr bool HIGH_IN_PLACE = false;
inline __m512i dot(__m512i acc, __m512i u, int32_t s) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, _mm512_set1_epi32(s)), _mm512_set1_epi16(1)));
}
#endif
constexpr float UNIT = HIGH_IN_PLACE ? 1.f / 16.f : 1.f;

inline __m512 load16(const uint16_t* h, const float* f) {
  return f ? _mm512_loadu_ps(f) : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}

// The tile's 16 rows against MM x rows: out[m] lane i = row i's product with x row m.
template <int MM>
__attribute__((always_inline)) inline void int4_tile(const TileArgs& a, __m512 (&out)[MM]) {
  const int64_t K = a.K, R = K / RUN, G = R / a.runs_a_group;
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  for (int m = 0; m < MM; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m512 sw = load16(a.s ? a.s + g * TILE : nullptr, a.s32 ? a.s32 + g * TILE : nullptr);
    const __m512 mw = load16(a.mn ? a.mn + g * TILE : nullptr, a.mn32 ? a.mn32 + g * TILE : nullptr);
    for (int64_t r = g * a.runs_a_group; r < (g + 1) * a.runs_a_group; ++r) {
      __m512i lo_sum[MM], hi_sum[MM];
      for (int m = 0; m < MM; ++m) lo_sum[m] = hi_sum[m] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const uint8_t* chunk = a.p + (r * 4 + c) * CHUNK_BYTES;
        _mm_prefetch(reinterpret_cast<const char*>(chunk + TM_I8_PREFETCH), TM_I8_HINT);
        const __m512i w = _mm512_loadu_si512(chunk);
        const __m512i lo = _mm512_and_si512(w, low);
        const __m512i hi = HIGH_IN_PLACE ? _mm512_and_si512(w, high) : _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
        for (int m = 0; m < MM; ++m) {
          const int8_t* x = a.xq + m * K + r * RUN + c * 8;
          lo_sum[m] = dot(lo_sum[m], lo, x4(x));
          hi_sum[m] = dot(hi_sum[m], hi, x4(x + 4));
        }
      }
      for (int m = 0; m < MM; ++m) {
        const __m512i sum = HIGH_IN_PLACE ? _mm512_add_epi32(_mm512_slli_epi32(lo_sum[m], 4), hi_sum[m])
                                          : _mm512_add_epi32(lo_sum[m], hi_sum[m]);
        const __m512 sc = _mm512_mul_ps(sw, _mm512_set1_ps(a.xs[m * R + r]));
        out[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), sc, out[m]);
        out[m] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.xsum[m * R + r]), out[m]);
      }
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2: a tile as two halves of 8 rows (32 bytes of each chunk), vpmaddubsw + vpmaddwd
constexpr float UNIT = 1.f;

inline __m256 load8(const uint16_t* h, const float* f) {
  return f ? _mm256_loadu_ps(f) : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

template <int MM>
inline void int4_tile(const TileArgs& a, __m256 (&out)[MM][2]) {
  const int64_t K = a.K, R = K / RUN, G = R / a.runs_a_group;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int m = 0; m < MM; ++m) out[m][0] = out[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int half = 0; half < 2; ++half) {
      const int64_t at = g * TILE + half * 8;
      const __m256 sw = load8(a.s ? a.s + at : nullptr, a.s32 ? a.s32 + at : nullptr);
      const __m256 mw = load8(a.mn ? a.mn + at : nullptr, a.mn32 ? a.mn32 + at : nullptr);
      for (int64_t r = g * a.runs_a_group; r < (g + 1) * a.runs_a_group; ++r) {
        __m256i sum[MM];
        for (int m = 0; m < MM; ++m) sum[m] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          const uint8_t* chunk = a.p + (r * 4 + c) * CHUNK_BYTES + half * 32;
          _mm_prefetch(reinterpret_cast<const char*>(chunk + TM_I8_PREFETCH), TM_I8_HINT);
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
          const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
          for (int m = 0; m < MM; ++m) {
            const int8_t* x = a.xq + m * K + r * RUN + c * 8;
            const __m256i d = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x4(x))),
                                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x4(x + 4))));
            sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(d, ones));  // (|d| <= 4 * 15 * 127: no saturation)
          }
        }
        for (int m = 0; m < MM; ++m) {
          const __m256 sc = _mm256_mul_ps(sw, _mm256_set1_ps(a.xs[m * R + r]));
          out[m][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m]), sc, out[m][half]);
          out[m][half] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.xsum[m * R + r]), out[m][half]);
        }
      }
    }
  }
}
#else
// other instruction sets: scalar, a row and a run at a time
constexpr float UNIT = 1.f;

template <int MM>
inline void int4_tile(const TileArgs& a, float (&out)[MM][TILE]) {
  const int64_t K = a.K, R = K / RUN;
  for (int m = 0; m < MM; ++m)
    for (int i = 0; i < TILE; ++i) out[m][i] = 0.f;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t g = r / a.runs_a_group;
    for (int i = 0; i < TILE; ++i) {
      const float s = a.s32 ? a.s32[g * TILE + i] : half_float(a.s[g * TILE + i]);
      const float mn = a.mn32 ? a.mn32[g * TILE + i] : half_float(a.mn[g * TILE + i]);
      for (int m = 0; m < MM; ++m) {
        int32_t dot = 0;
        for (int c = 0; c < 4; ++c)
          for (int j = 0; j < 4; ++j) {
            const uint8_t b = a.p[(r * 4 + c) * CHUNK_BYTES + 4 * i + j];
            const int8_t* x = a.xq + m * K + r * RUN + c * 8;
            dot += (b & 15) * x[j] + (b >> 4) * x[4 + j];
          }
        out[m][i] += s * a.xs[m * R + r] * static_cast<float>(dot) + mn * a.xsum[m * R + r];
      }
    }
  }
}
#endif

// Tiles [tile0, T) of y [M, N] = x @ W^T (+ bias): output columns from 16 * tile0. Few rows (decode):
// each block of 8 x rows against the thread's tiles in turn. Many rows (`tile_outer`): each tile against
// every block of x rows in turn, so its weights stay in L1 while the rows stream past.
template <typename T>
void int4_impl(at::Tensor& out, const T* x, int64_t x_row, int64_t M, const at::Tensor& packed,
               const at::Tensor& scales, const at::Tensor& mins, int64_t group, const T* bias, int64_t tile0,
               bool tile_outer) {
  const int64_t N = out.size(1), tiles = packed.size(0), K = packed.size(1) * 8, G = K / group, R = K / RUN;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * R), xsum(M * R);
  at::parallel_for(0, M, tile_outer ? 16 : M, [&](int64_t begin, int64_t end) {
    quantize_runs(x + begin * x_row, x_row, end - begin, K, UNIT, xq.data() + begin * K, xs.data() + begin * R,
                  xsum.data() + begin * R);
  });
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const bool scales32 = scales.scalar_type() == at::kFloat, mins32 = mins.scalar_type() == at::kFloat;
  const uint16_t* sp = scales32 ? nullptr : reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const float* sp32 = scales32 ? scales.data_ptr<float>() : nullptr;
  const uint16_t* mp = mins32 ? nullptr : reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  const float* mp32 = mins32 ? mins.data_ptr<float>() : nullptr;
  T* y = out.data_ptr<T>();
  const int64_t y_row = out.stride(0);
  // ~32 KB of weights a thread at least
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (K * TILE));
  at::parallel_for(tile0, tiles, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[TILE];
    // (tile_outer: one tile a pass over the row blocks; else the thread's whole range)
    for (int64_t t0 = begin; t0 < end; t0 += tile_outer ? 1 : end - begin)
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
      const int64_t mm = std::min(MAX_ROWS, M - m0);
      const int64_t t1 = tile_outer ? t0 + 1 : end;
      with_rows<MAX_ROWS>(mm, [&]<int MM>() {
        for (int64_t t = t0; t < t1; ++t) {
          const TileArgs a{pp + t * K * 8,
                           sp ? sp + t * G * TILE : nullptr,
                           sp32 ? sp32 + t * G * TILE : nullptr,
                           mp ? mp + t * G * TILE : nullptr,
                           mp32 ? mp32 + t * G * TILE : nullptr,
                           static_cast<int>(group / RUN),
                           K,
                           xq.data() + m0 * K,
                           xs.data() + m0 * R,
                           xsum.data() + m0 * R};
          const int64_t n0 = t * TILE, nb = std::min<int64_t>(TILE, N - n0);
#if defined(TM_INT4_512)
          __m512 tot[MM];
          int4_tile<MM>(a, tot);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
          __m256 tot[MM][2];
          int4_tile<MM>(a, tot);
#else
          float tot[MM][TILE];
          int4_tile<MM>(a, tot);
#endif
          for (int m = 0; m < MM; ++m) {
#if defined(TM_INT4_512)
            _mm512_store_ps(sums, tot[m]);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
            _mm256_store_ps(sums, tot[m][0]);
            _mm256_store_ps(sums + 8, tot[m][1]);
#else
            std::memcpy(sums, tot[m], sizeof(sums));
#endif
            if (bias)
              for (int64_t i = 0; i < nb; ++i) sums[i] += static_cast<float>(bias[n0 + i]);
            from_float_row(sums, y + (m0 + m) * y_row + n0, nb);
          }
        }
      });
    }
  });
}

}  // namespace

namespace tokenmill {

// out [M, N] = x [M, K] @ W^T (+ bias), W as packed [ceil(N / 16), K / 8, 64] (uint8, the tiles above),
// scales and mins [ceil(N / 16), K / group, 16] (each float16 or float32). amx: the weights dequantized
// into AMX's bfloat16 tiles (prompt chunks), else the integer dot products above; many_rows: their
// loops ordered for many x rows (each tile's weights kept in L1 for every row block).
void linear_int4(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                 const at::Tensor& mins, int64_t group, const c10::optional<at::Tensor>& bias, bool amx,
                 bool many_rows) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_int4: x must be [M, K] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0),
              "linear_int4: out must be [M, N] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), tiles = (N + TILE - 1) / TILE;
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.size(0) == tiles && packed.size(1) * 8 == K && packed.size(2) == CHUNK_BYTES && K % 32 == 0,
              "linear_int4: packed must be contiguous uint8 [ceil(N / 16), K / 8, 64] for x [M, K] and out [M, N], "
              "K a multiple of 32");
  TORCH_CHECK(group >= 32 && group <= 4096 && (group & (group - 1)) == 0 && K % group == 0,
              "linear_int4: group must be a power of two from 32 to 4096 dividing K, got ", group);
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf || t->scalar_type() == at::kFloat,
                "linear_int4: scales and mins must be float16 or float32");
    TORCH_CHECK(t->dim() == 3 && t->is_contiguous() && t->size(0) == tiles && t->size(1) == K / group &&
                    t->size(2) == TILE,
                "linear_int4: scales and mins must be contiguous [ceil(N / 16), K / group, 16]");
  }
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  out.scalar_type() == x.scalar_type(),
              "linear_int4: x and out float32 or bfloat16, one dtype");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                                     bias->numel() == N),
              "linear_int4: bias must be contiguous [N] in x's dtype");
  if (M == 0 || N == 0) return;
  int64_t done = 0;  // output columns the AMX path wrote (whole tiles)
  if (amx) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_int4: the AMX mode takes bfloat16 x");
#if defined(TM_AMX)
    // the weights dequantized 32 k of a row at a time (q * scale + min: one group a step) into bfloat16 tiles
    const uint8_t* pp = packed.data_ptr<uint8_t>();
    const bool scales32 = scales.scalar_type() == at::kFloat, mins32 = mins.scalar_type() == at::kFloat;
    const uint16_t* sp = scales32 ? nullptr : reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
    const float* sp32 = scales32 ? scales.data_ptr<float>() : nullptr;
    const uint16_t* mp = mins32 ? nullptr : reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
    const float* mp32 = mins32 ? mins.data_ptr<float>() : nullptr;
    const int64_t G = K / group;
    const int shift = std::countr_zero(static_cast<uint64_t>(group));
    bf16* y = out.data_ptr<bf16>();
    const bf16* b = bias ? bias->data_ptr<bf16>() : nullptr;
    const int64_t y_row = out.stride(0);
    const __m128i low = _mm_set1_epi8(0x0F);
    const auto rows = [&](int64_t n, int64_t k) {
      // row n's k .. k + 31: its 4 bytes in each of the run's 4 chunks
      const int64_t t = n / TILE, i = n % TILE;
      const uint8_t* at = pp + t * K * 8 + (k / 8) * CHUNK_BYTES + 4 * i;
      const __m128i v = _mm_setr_epi32(x4(reinterpret_cast<const int8_t*>(at)),
                                       x4(reinterpret_cast<const int8_t*>(at + CHUNK_BYTES)),
                                       x4(reinterpret_cast<const int8_t*>(at + 2 * CHUNK_BYTES)),
                                       x4(reinterpret_cast<const int8_t*>(at + 3 * CHUNK_BYTES)));
      const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
      // chunk c: its low nibbles are k 8c .. 8c + 3, its high ones 8c + 4 .. 8c + 7
      const __m128i first = _mm_unpacklo_epi32(lo, hi), second = _mm_unpackhi_epi32(lo, hi);  // k 0-15, 16-31
      const int64_t g = (t * G + (k >> shift)) * TILE + i;
      const __m512 s = _mm512_set1_ps(sp32 ? sp32[g] : _cvtsh_ss(sp[g]));
      const __m512 m = _mm512_set1_ps(mp32 ? mp32[g] : _cvtsh_ss(mp[g]));
      const __m512 flo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first)), s, m);
      const __m512 fhi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second)), s, m);
      return tm_amx::to_bf16x32(flo, fhi);
    };
    // (only whole blocks of 32 rows, all below N: a partial tile's padding rows are not read)
    done = tm_amx::linear_rows_bf16(x.data_ptr<bf16>(), x.stride(0), M, N / TILE * TILE, K, rows,
                                    [&](int64_t mi, int64_t n, float sum) {
                                      y[mi * y_row + n] = from_float<bf16>(sum + (b ? static_cast<float>(b[n]) : 0.f));
                                    });
#endif
    if (done >= N) return;
  }
  // the tiles past the AMX blocks (or all): integer dot products
  if (x.scalar_type() == at::kFloat)
    int4_impl<float>(out, x.data_ptr<float>(), x.stride(0), M, packed, scales, mins, group,
                     bias ? bias->data_ptr<float>() : nullptr, done / TILE, many_rows);
  else
    int4_impl<bf16>(out, x.data_ptr<bf16>(), x.stride(0), M, packed, scales, mins, group,
                    bias ? bias->data_ptr<bf16>() : nullptr, done / TILE, many_rows);
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def(
      "linear_int4(Tensor(a!) out, Tensor x, Tensor packed, Tensor scales, Tensor mins, int group, Tensor? bias, "
      "bool amx, bool many_rows=False) -> ()");
  m.impl("linear_int4", c10::DispatchKey::CPU, &tokenmill::linear_int4);
}

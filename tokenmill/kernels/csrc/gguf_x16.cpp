// Products on GGUF's Q4_K, Q5_K, Q6_K, Q4_0, Q4_1 and Q8_0 matrices repacked at load into groups of 16
// rows ("x16", GGML type + 100; the layout: gguf_x16_pack.h), so that they need no horizontal sums: one
// 512-bit register holds 4 consecutive weights of each of 16 rows, vpdpbusd multiplies them with 4
// bytes of x broadcast to every row (64 multiply-adds an instruction, 4 a lane), and its 16 int32 lanes
// are the 16 rows' sums. A run of weights that shares a scale (32 in Q4_K / Q5_K, 16 in Q6_K, a block
// in the 32-weight types) is summed that way, then times the 16 rows' scales (vpmulld) into the block's
// int32 sum; the block's float step (d, -dmin, x's scale) is one fma a row of x for 16 rows. The file's
// blocks take 2 multiply instructions a 64 weights and a horizontal sum a block and x row
// (gguf_kdot.h); these take about 1.1.
//
// For the K-quants x is rounded as for the file's blocks (gguf_kdot.h: int8 per 256, with its per-16 and
// per-32 sums), so the products are the same integer sums; the float step is, for each row of x and of
// W, a block at a time: acc = fma(dot, d * xd, acc), then (Q4_K, Q5_K) acc = fma(mins, -dmin * xd, acc),
// the same for any number of x rows. The 32-weight types round x per 32, with the integer sums of each
// 32 (Q4_0's offset 8, Q8_0's 128 as stored; Q4_1's m times them in float), and take acc = fma(dot, d *
// xd, acc) a block. With AVX2 alone the same sums by vpmaddubsw, 8 rows a register (gguf_x16_avx2.h);
// without AVX2, in scalar form (tests; loaders repack only where a rule chose the form).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "convert.h"
#include "gguf_formats.h"
#include "gguf_x16.h"
#include "gguf_x16_avx2.h"
#include "gguf_x16_pack.h"
#include "int_dot.h"

namespace {

using namespace tm_gguf;
using bf16 = c10::BFloat16;
using namespace tm_x16;

constexpr int XROWS = 8;                       // x rows a pass over a group's block
constexpr int64_t TILE_BYTES = int64_t{96} << 10;  // weight bytes a thread's tile (in L2 across x passes)

constexpr int64_t PF_BYTES = 4736;  // how far ahead of a group's reads they are prefetched (few x rows wait on memory)

// ---- the product: MM x rows (from m0) . a group's 16 rows, all its blocks -> out[m * 16 + r] ----
// The scalar forms are kept out of GCC's vectorizer: GCC 12 at -march=native with AVX-512 VNNI turns a
// sum of int8 * int8 products into vpdpbusd, which takes one side unsigned (Q8_0's negative weights
// came out 256 too large).
#if defined(__GNUC__) && !defined(__clang__)
#define TM_SCALAR_REFERENCE __attribute__((optimize("no-tree-vectorize")))
#else
#define TM_SCALAR_REFERENCE
#endif

template <int TYPE, int MM>
TM_SCALAR_REFERENCE void group_scalar(const uint8_t* g, const KX& x, int64_t m0, float* out) {
  const int64_t K = x.K, NB = K / QK;
  for (int m = 0; m < MM; ++m)
    for (int r = 0; r < ROWS; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < NB; ++b) {
        const uint8_t* gb = g + b * group_bytes(TYPE);
        uint8_t p[210];
        unpack_block<TYPE>(gb, r, p);
        alignas(32) uint8_t q[256];
        const int8_t* xq = x.q.data() + (m0 + m) * K + b * QK;
        const float xd = x.d[(m0 + m) * NB + b];
        int32_t dot = 0, mins = 0;
        if constexpr (TYPE == 12 || TYPE == 13) {
          for (int R = 0; R < 8; ++R) {
            run_scalar<std::conditional_t<TYPE == 12, Q4_K, Q5_K>>(p, R, q);
            int32_t t = 0;
            for (int l = 0; l < 32; ++l) t += q[l] * xq[32 * R + l];
            dot += gb[2112 + 16 * R + r] * t;
            mins += gb[2240 + 32 * (R / 2) + 2 * r + R % 2] * x.sum32[(m0 + m) * (K / 32) + b * 8 + R];
          }
          acc = std::fma(static_cast<float>(dot), half_bits(gb + 2048 + 2 * r) * xd, acc);
          acc = std::fma(static_cast<float>(mins), -half_bits(gb + 2080 + 2 * r) * xd, acc);
        } else {
          for (int R = 0; R < 8; ++R) run_scalar<Q6_K>(p, R, q + 32 * R);
          for (int G = 0; G < 16; ++G) {
            int32_t t = 0;
            for (int l = 0; l < 16; ++l) t += q[16 * G + l] * xq[16 * G + l];
            dot += static_cast<int8_t>(gb[3072 + 16 * G + r]) * (t - 32 * x.sum16[(m0 + m) * (K / 16) + b * 16 + G]);
          }
          acc = std::fma(static_cast<float>(dot), half_bits(gb + 3328 + 2 * r) * xd, acc);
        }
      }
      out[m * ROWS + r] = acc;
    }
}


template <int TYPE, int MM>
TM_SCALAR_REFERENCE void group_scalar(const uint8_t* g, const X32& x, int64_t m0, float* out) {
  const int64_t K = x.K, NB = K / 32;
  for (int m = 0; m < MM; ++m)
    for (int r = 0; r < ROWS; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < NB; ++b) {
        uint8_t p[34];
        unpack_block<TYPE>(g + b * group_bytes(TYPE), r, p);
        const int8_t* xq = x.q.data() + (m0 + m) * K + b * 32;
        int32_t dot = 0;
        for (int l = 0; l < 32; ++l) {
          int q = static_cast<int8_t>(p[2 + l]);  // (Q8_0)
          if constexpr (TYPE != 8) q = ((p[nibbles_at(TYPE) + l % 16] >> (4 * (l / 16))) & 15) - (TYPE == 2 ? 8 : 0);
          dot += q * xq[l];
        }
        const float xd = x.d[(m0 + m) * NB + b];
        acc = std::fma(static_cast<float>(dot), half_bits(p) * xd, acc);
        if constexpr (TYPE == 3) acc = std::fma(half_bits(p + 2), xd * static_cast<float>(x.s[(m0 + m) * NB + b]), acc);
      }
      out[m * ROWS + r] = acc;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TM_X16_VNNI 1
inline __m512i ld64(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline __m512i bcast4(const int8_t* p) {  // 4 bytes of x to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline __m512 halves16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

template <int TYPE, int MM>  // Q4_K, Q5_K (its fifth bits: a line a run)
void q4k_group(const uint8_t* g, const KX& x, int64_t m0, float* out) {
  constexpr int64_t GB = group_bytes(TYPE);
  const int64_t K = x.K, NB = K / QK;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 facc[MM];
  for (int m = 0; m < MM; ++m) facc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* gb = g + b * GB;
    __m512i acc[MM];
    for (int m = 0; m < MM; ++m) acc[m] = _mm512_setzero_si512();
    for (int R = 0; R < 8; ++R) {  // run R: 32 weights of each row, one scale a row
      for (int c = 0; c < GB / 512 + 1; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(gb + 2 * GB + (GB / 512 + 1) * 64 * R + 64 * c), _MM_HINT_T0);
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 2112 + 16 * R)));
      __m512i q[8];
      for (int i = 0; i < 4; ++i) {
        const __m512i v = ld64(gb + (4 * R + i) * 64);
        q[i] = _mm512_and_si512(v, low), q[4 + i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      if constexpr (TYPE == 13) {  // bit i / 4 + i of the run's line -> bit 4 of q[i] / q[4 + i]
        const __m512i h = ld64(gb + 2368 + 64 * R), five = _mm512_set1_epi8(16);
        for (int i = 0; i < 4; ++i) {
          q[i] = _mm512_ternarylogic_epi32(q[i], _mm512_slli_epi16(h, 4 - i), five, 0xF8);  // a | (b & c)
          q[4 + i] = _mm512_ternarylogic_epi32(q[4 + i], _mm512_srli_epi16(h, i), five, 0xF8);
        }
      }
      for (int m = 0; m < MM; ++m) {
        const int8_t* xr = x.q.data() + (m0 + m) * K + b * QK + 32 * R;
        __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], bcast4(xr));
        for (int i = 1; i < 8; ++i) t = _mm512_dpbusd_epi32(t, q[i], bcast4(xr + 4 * i));
        acc[m] = _mm512_add_epi32(acc[m], _mm512_mullo_epi32(t, sc));
      }
    }
    __m512i mn[4];
    for (int k = 0; k < 4; ++k) mn[k] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + 2240 + 32 * k)));
    const __m512 d = halves16(gb + 2048), nmin = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(halves16(gb + 2080)), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u))));
    for (int m = 0; m < MM; ++m) {
      const int16_t* s32 = x.sum32.data() + (m0 + m) * (K / 32) + b * 8;
      __m512i mins = _mm512_setzero_si512();
      for (int k = 0; k < 4; ++k) mins = _mm512_dpwssd_epi32(mins, mn[k], bcast4(reinterpret_cast<const int8_t*>(s32 + 2 * k)));
      const __m512 xd = _mm512_set1_ps(x.d[(m0 + m) * NB + b]);
      facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_mul_ps(d, xd), facc[m]);
      facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(nmin, xd), facc[m]);
    }
  }
  for (int m = 0; m < MM; ++m) _mm512_storeu_ps(out + m * ROWS, facc[m]);
}

template <int MM>
void q6k_group(const uint8_t* g, const KX& x, int64_t m0, float* out) {
  const int64_t K = x.K, NB = K / QK;
  const __m512i low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
  __m512 facc[MM];
  for (int m = 0; m < MM; ++m) facc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* gb = g + b * 3360;
    __m512i acc[MM];
    for (int m = 0; m < MM; ++m) acc[m] = _mm512_setzero_si512();
    for (int G = 0; G < 16; ++G) {  // 16 weights of each row, one scale a row
      for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(gb + 2 * 3360 + (4 * G + c) * 64), _MM_HINT_T0);
      const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(gb + 3072 + 16 * G)));
      const __m512i l0 = ld64(gb + 2 * G * 64), l1 = ld64(gb + (2 * G + 1) * 64), h = ld64(gb + 2048 + G * 64);
      const __m512i q[4] = {
          _mm512_or_si512(_mm512_and_si512(l0, low), _mm512_and_si512(_mm512_slli_epi16(h, 4), top)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), low), _mm512_and_si512(_mm512_slli_epi16(h, 2), top)),
          _mm512_or_si512(_mm512_and_si512(l1, low), _mm512_and_si512(h, top)),
          _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), low), _mm512_and_si512(_mm512_srli_epi16(h, 2), top))};
      for (int m = 0; m < MM; ++m) {
        const int8_t* xr = x.q.data() + (m0 + m) * K + b * QK + 16 * G;
        __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], bcast4(xr));
        for (int i = 1; i < 4; ++i) t = _mm512_dpbusd_epi32(t, q[i], bcast4(xr + 4 * i));
        t = _mm512_sub_epi32(t, _mm512_set1_epi32(32 * x.sum16[(m0 + m) * (K / 16) + b * 16 + G]));
        acc[m] = _mm512_add_epi32(acc[m], _mm512_mullo_epi32(t, sc));
      }
    }
    const __m512 d = halves16(gb + 3328);
    for (int m = 0; m < MM; ++m) {
      const __m512 xd = _mm512_set1_ps(x.d[(m0 + m) * NB + b]);
      facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_mul_ps(d, xd), facc[m]);
    }
  }
  for (int m = 0; m < MM; ++m) _mm512_storeu_ps(out + m * ROWS, facc[m]);
}

// Q4_0 (q - 8: the x sums' 8 times taken off), Q4_1 (d * q + m: m times the x sums in float) and Q8_0
// (stored q + 128: 128 times), 32 weights a block
template <int TYPE, int MM>
void q32_group(const uint8_t* g, const X32& x, int64_t m0, float* out) {
  const int64_t K = x.K, NB = K / 32;
  constexpr int64_t GB = group_bytes(TYPE);
  constexpr int32_t OFF = TYPE == 2 ? 8 : TYPE == 3 ? 0 : 128;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 facc[MM];
  for (int m = 0; m < MM; ++m) facc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < NB; ++b) {
    const uint8_t* gb = g + b * GB;
    // A Q8_0 group's block is one run of 544 bytes, which the hardware prefetcher follows: at one x row
    // the nine software prefetches a block slow the stream down; with more x rows each block is held
    // longer and they pay. The 4-bit types' runs came out level either way (benchmarks/RESULTS.md,
    // "The x16 products' software prefetch").
    if constexpr (TYPE != 8 || MM > 1)
      for (int c = 0; c < (GB + 63) / 64; ++c) _mm_prefetch(reinterpret_cast<const char*>(gb + PF_BYTES + 64 * c), _MM_HINT_T0);
    __m512i q[8];
    if constexpr (TYPE != 8) {
      for (int i = 0; i < 4; ++i) {
        const __m512i v = ld64(gb + 64 * i);
        q[i] = _mm512_and_si512(v, low), q[4 + i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int i = 0; i < 8; ++i) q[i] = ld64(gb + 64 * i);
    }
    const __m512 d = halves16(gb + (TYPE == 8 ? 512 : 256));
    for (int m = 0; m < MM; ++m) {
      const int8_t* xr = x.q.data() + (m0 + m) * K + b * 32;
      __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], bcast4(xr));
      for (int i = 1; i < 8; ++i) t = _mm512_dpbusd_epi32(t, q[i], bcast4(xr + 4 * i));
      if constexpr (OFF != 0) t = _mm512_sub_epi32(t, _mm512_set1_epi32(OFF * x.s[(m0 + m) * NB + b]));
      const float xs = x.d[(m0 + m) * NB + b];
      facc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, _mm512_set1_ps(xs)), facc[m]);
      if constexpr (TYPE == 3)
        facc[m] = _mm512_fmadd_ps(halves16(gb + 288), _mm512_set1_ps(xs * static_cast<float>(x.s[(m0 + m) * NB + b])), facc[m]);
    }
  }
  for (int m = 0; m < MM; ++m) _mm512_storeu_ps(out + m * ROWS, facc[m]);
}
#endif

template <int TYPE, int MM>
inline void group_dot(const uint8_t* g, const X32& x, int64_t m0, float* out) {
#if defined(TM_X16_VNNI)
  q32_group<TYPE, MM>(g, x, m0, out);
#elif defined(TM_X16_AVX2)
  group_avx2<TYPE, MM>(g, x, m0, out);
#else
  group_scalar<TYPE, MM>(g, x, m0, out);
#endif
}

template <int TYPE, int MM>
inline void group_dot(const uint8_t* g, const KX& x, int64_t m0, float* out) {
#if defined(TM_X16_VNNI)
  if constexpr (TYPE == 12 || TYPE == 13)
    q4k_group<TYPE, MM>(g, x, m0, out);
  else
    q6k_group<MM>(g, x, m0, out);
#elif defined(TM_X16_AVX2)
  group_avx2<TYPE, MM>(g, x, m0, out);
#else
  group_scalar<TYPE, MM>(g, x, m0, out);
#endif
}

// x [M, K] rounded per 256 (gguf_kdot.h; no groups: these products read x's rows as they are), or per 32
// as round_block rounds (nearest even; a block of zeros: scale 0), rows in parallel when there are many
template <typename T>
void round_x(const T* x, int64_t x_row, int64_t M, int64_t K, KX& xk) {
  quantize_x256(x, x_row, M, K, xk, false);
}

template <typename T>
void round_x(const T* x, int64_t x_row, int64_t M, int64_t K, X32& xk) {
  xk.K = K, xk.q.resize(M * K), xk.d.resize(M * (K / 32)), xk.s.resize(M * (K / 32));
  at::parallel_for(0, M, M > XROWS ? 16 : std::max<int64_t>(1, M), [&](int64_t b, int64_t e) {
    alignas(32) float v[32];
    for (int64_t m = b; m < e; ++m)
      for (int64_t blk = 0; blk < K / 32; ++blk) {
        to_float(x + m * x_row + blk * 32, v, 32);
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* q = xk.q.data() + m * K + blk * 32;
        int32_t sum = 0;
        for (int i = 0; i < 32; ++i) sum += q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
        xk.d[m * (K / 32) + blk] = amax / 127.f, xk.s[m * (K / 32) + blk] = sum;
      }
  });
}

// f.template operator()<GGML type>() for an x16 type number
template <typename Fn>
void with_x16(int64_t type, Fn&& f) {
  switch (type) {
    case tm_x16::Q4_016: f.template operator()<2>(); break;
    case tm_x16::Q4_116: f.template operator()<3>(); break;
    case tm_x16::Q8_016: f.template operator()<8>(); break;
    case tm_x16::Q4_K16: f.template operator()<12>(); break;
    case tm_x16::Q5_K16: f.template operator()<13>(); break;
    case tm_x16::Q6_K16: f.template operator()<14>(); break;
    default: TORCH_CHECK(false, "gguf: not a 16-row repacked type: ", type);
  }
}

// threads over tiles of groups; each tile's groups in L2 while every pass of XROWS x rows goes over them
template <int TYPE, typename T>
void linear16(at::Tensor& out, const T* x, int64_t x_row, int64_t M, int64_t K, const at::Tensor& w) {
  std::conditional_t<block_weights(TYPE) == 256, KX, X32> xk;
  round_x(x, x_row, M, K, xk);
  const int64_t groups = w.size(0) / ROWS, gbytes = ROWS * w.size(1), y_row = out.stride(0);
  // tiles of at most TILE_BYTES (one pass of x: the groups split evenly), as many a thread
  const int64_t threads = at::get_num_threads();
  int64_t tiles = M <= XROWS ? threads : (groups * gbytes + TILE_BYTES - 1) / TILE_BYTES;
  tiles = std::min(groups, (tiles + threads - 1) / threads * threads);
  const int64_t per_tile = (groups + tiles - 1) / tiles;
  tiles = (groups + per_tile - 1) / per_tile;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  T* y = out.data_ptr<T>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float sums[XROWS * ROWS];
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m0 = 0; m0 < M; m0 += XROWS)
        tm_int::with_rows<XROWS>(std::min<int64_t>(XROWS, M - m0), [&]<int MM>() {
          for (int64_t gi = t * per_tile; gi < std::min(groups, (t + 1) * per_tile); ++gi) {
            group_dot<TYPE, MM>(wp + gi * gbytes, xk, m0, sums);
            for (int m = 0; m < MM; ++m)
              for (int r = 0; r < ROWS; ++r) y[(m0 + m) * y_row + gi * ROWS + r] = from_float<T>(sums[m * ROWS + r]);
          }
        });
  });
}

}  // namespace

namespace tokenmill {

bool gguf_x16_type(int64_t type) {
  return type == tm_x16::Q4_K16 || type == tm_x16::Q5_K16 || type == tm_x16::Q6_K16 || type == tm_x16::Q4_016 ||
         type == tm_x16::Q4_116 || type == tm_x16::Q8_016;
}

void gguf_x16_check(const char* op, const at::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.stride(1) == 1 && w.stride(0) == w.size(1),
              op, ": blocks must be contiguous uint8 [N, row bytes]");
  const int t = static_cast<int>(type - 100);
  TORCH_CHECK(K % block_weights(t) == 0 && w.size(1) == K / block_weights(t) * group_bytes(t) / ROWS &&
                  w.size(0) % ROWS == 0,
              op, ": [", w.size(0), ", ", w.size(1), "] bytes are not a 16-row repacked matrix of ", K,
              " columns of type ", type);
}

// W's file blocks [N, row bytes] (Q4_0, Q4_1, Q8_0, Q4_K or Q6_K; N a multiple of 16) -> their x16 form
at::Tensor gguf_repack16(const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(gguf_x16_type(type + 100),
              "gguf_repack16: Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), Q5_K (13) or Q6_K (14), got ", type);
  const int t = static_cast<int>(type);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(0) % ROWS == 0 && blocks.size(1) % file_bytes(t) == 0,
              "gguf_repack16: blocks must be contiguous uint8 [N, row bytes], N a multiple of 16");
  const int64_t N = blocks.size(0), NB = blocks.size(1) / file_bytes(t), gb = group_bytes(t);
  at::Tensor out = at::empty({N, NB * gb / ROWS}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t src_row = blocks.size(1);
  with_x16(type + 100, [&]<int TYPE>() {
    at::parallel_for(0, N / ROWS, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < NB; ++b) pack_block<TYPE>(src + g * ROWS * src_row + b * file_bytes(TYPE), src_row, dst + (g * NB + b) * gb);
    });
  });
  return out;
}

// row n of an x16 matrix as the file held it [row bytes of the file's type]
void gguf_x16_file_row(const uint8_t* w, int64_t row_bytes16, int64_t type, int64_t K, int64_t n, uint8_t* row) {
  with_x16(type, [&]<int TYPE>() {
    const uint8_t* gp = w + n / ROWS * ROWS * row_bytes16;
    for (int64_t b = 0; b < K / block_weights(TYPE); ++b)
      unpack_block<TYPE>(gp + b * group_bytes(TYPE), static_cast<int>(n % ROWS), row + b * file_bytes(TYPE));
  });
}

void gguf_x16_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  const int64_t M = x.size(0), K = x.size(1);
  gguf_x16_check("gguf_linear", blocks, type, K);
  if (M == 0 || blocks.size(0) == 0) return;
  with_x16(type, [&]<int TYPE>() {
    if (x.scalar_type() == at::kFloat)
      linear16<TYPE, float>(out, x.data_ptr<float>(), x.stride(0), M, K, blocks);
    else
      linear16<TYPE, bf16>(out, x.data_ptr<bf16>(), x.stride(0), M, K, blocks);
  });
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("gguf_repack16(Tensor blocks, int type) -> Tensor");
  m.impl("gguf_repack16", c10::DispatchKey::CPU, &tokenmill::gguf_repack16);
}

// Linear layers with int4 weights on the CPU, for decode batches (few x rows): y [M, N] = x [M, K] @
// W^T (+ bias), W in asymmetric groups: W[n, k] = q[n, k] * scales[n, g] + mins[n, g], g = k / group,
// q in 0..15, scales and mins float16 (the grid GGUF's Q4_1 stores) or float32 (checkpoints' scales that
// float16 would round, AWQ's and GPTQ's -zero * scale: exact there).
//
// Layout (`packed` [N, K / 2] uint8, tokenmill's own): each row in blocks of 64 k, byte j (0..31) of a
// block holding k = j in its low nibble and k = 32 + j in its high one, so one 32-byte load gives two
// runs of 32 consecutive k; a last block of 32 k (K % 64 == 32) holds k = j and 16 + j in its 16 bytes.
//
// x rows are quantized to int8 in runs of 32 k, one float scale a run (llama.cpp's Q8_0 activations),
// so a run's product is one integer dot of unsigned nibbles with signed bytes (vpdpbusd: 64 products an
// instruction; AVX2: vpmaddubsw + vpmaddwd), scaled once by scale(w) * scale(x); the mins' share,
// min * sum(x over the group), takes the runs' float sums of x, made once per call. On the AMX machine
// this took the peer model's int4 products at one row from 1.03 ms (x in 16-bit fixed point, nibbles
// widened to int16, vpdpwssd) to the figure in benchmarks/results/quantization.json. One weight row at
// a time against up to 8 x rows, each thread a contiguous range of rows; group a power of two from 32
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
#include <vector>

#include "convert.h"
#include "int_dot.h"
#include "linear_amx.h"

namespace {

using namespace tm_int;
using bf16 = c10::BFloat16;
constexpr int64_t MAX_ROWS = 8;
constexpr int64_t RUN = 32;  // k per x scale

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
#define TM_INT4_512 1
// AVX-512 reads 128 k (64 bytes, two blocks) a load: its low nibbles are k 0-31 and 64-95, its high
// ones k 32-63 and 96-127, so x is stored in that order within each whole 128 k.
constexpr bool CHUNKED = true;
#else
constexpr bool CHUNKED = false;
#endif

// Where run r of a row's x goes (the order above within whole 128-k chunks, natural elsewhere).
inline int64_t run_offset(int64_t r, int64_t K) {
  if (!CHUNKED || r >= K / 128 * 4) return r * RUN;
  constexpr int64_t place[4] = {0, 64, 32, 96};
  return r / 4 * 128 + place[r % 4];
}

// x [M, K] -> xq [M, K] (int8, each run of 32 symmetric with its own scale, in run_offset order),
// xs [M, K / 32] the runs' scales, xsum [M, K / 32] their float sums.
template <typename T>
void quantize_runs(const T* x, int64_t x_row, int64_t M, int64_t K, int8_t* xq, float* xs, float* xsum) {
  const int64_t R = K / RUN;
  float v[RUN];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < R; ++r) {
      to_float(x + m * x_row + r * RUN, v, RUN);
#if defined(TM_INT4_512)
      // (vectorized: at one row the scalar loop cost a tenth of the product of a 512 x 512 layer)
      const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      int8_t* q = xq + m * K + run_offset(r, K);  // rounded to nearest even, as nearbyint
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv))));
      xs[m * R + r] = amax / 127.f;
      xsum[m * R + r] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
#else
      float amax = 0.f, sum = 0.f;
      for (int i = 0; i < RUN; ++i) amax = std::max(amax, std::fabs(v[i])), sum += v[i];
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* q = xq + m * K + run_offset(r, K);
      for (int i = 0; i < RUN; ++i) q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
      xs[m * R + r] = amax / 127.f;
      xsum[m * R + r] = sum;
#endif
    }
}

// The value of k in a row's packed bytes.
inline int32_t nibble(const uint8_t* row, int64_t K, int64_t k) {
  const int64_t block = k / 64, in = k % 64;
  if (block * 64 + 64 <= K) return (row[block * 32 + in % 32] >> (in < 32 ? 0 : 4)) & 15;
  return (row[block * 32 + in % 16] >> (in < 16 ? 0 : 4)) & 15;  // the last block of 32
}

inline float half_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// One weight row against a few x rows: what a kernel needs to know of them (`min_at`: a group's minimum).
struct RowArgs {
  const uint8_t* p;   // the row's packed bytes
  const uint16_t* s;  // its scales [G] (float16 bits), or
  const float* s32;   // its scales [G] in float32 (a checkpoint's that float16 would round)
  const uint16_t* mn; // its mins [G] (float16), or
  const float* mn32;  // its mins [G] in float32 (a checkpoint's -zero * scale, exact there)
  int shift;          // log2(group) - 5: runs a group
  int64_t K;
  const int8_t* xq;   // x rows [MM, K]
  const float* xs;    // [MM, R]
  const float* xsum;  // [MM, R]
};

inline float min_at(const RowArgs& a, int64_t g) { return a.mn32 ? a.mn32[g] : half_float(a.mn[g]); }
inline float scale_at(const RowArgs& a, int64_t g) { return a.s32 ? a.s32[g] : half_float(a.s[g]); }

#if defined(TM_INT4_512)
// unsigned bytes u . signed bytes s, four adjacent products summed into each int32 lane
inline __m512i dot512(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}
inline __m256i dot256(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
inline __m128i dot128(__m128i u, __m128i s) {
#if defined(__AVX512VNNI__)
  return _mm_dpbusd_epi32(_mm_setzero_si128(), u, s);
#else
  return _mm_madd_epi16(_mm_maddubs_epi16(u, s), _mm_set1_epi16(1));
#endif
}

// 16 lanes: the values (float16 `v`, or float32 `v32` where given) of runs r0 .. r0 + 15 (value index
// r >> shift), zero past `count` runs
inline __m512 per_run(const uint16_t* v, const float* v32, int64_t r0, int count, int shift) {
  const int64_t first = r0 >> shift;
  const int values = ((r0 + count - 1) >> shift) - first + 1;
  const __mmask16 loaded = static_cast<__mmask16>((1u << values) - 1);
  const __m512 h = v32 ? _mm512_maskz_loadu_ps(loaded, v32 + first)
                       : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(loaded, v + first));
  if (shift == 0) return h;
  const __m512i idx = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(r0)),
                                                                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
                                                         shift),
                                       _mm512_set1_epi32(static_cast<int>(first)));
  return _mm512_maskz_permutexvar_ps(static_cast<__mmask16>((1u << count) - 1), idx, h);
}

// Lane permutations putting a segment's 16 run scales where a chunk's products are: chunk j's low
// nibbles hold runs 4j (lanes 0-7) and 4j + 2 (lanes 8-15), its high ones runs 4j + 1 and 4j + 3.
alignas(64) constexpr int32_t RUN_LANES[8][16] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2},         {1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3},
    {4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6},         {5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 10, 10, 10, 10, 10, 10, 10, 10}, {9, 9, 9, 9, 9, 9, 9, 9, 11, 11, 11, 11, 11, 11, 11, 11},
    {12, 12, 12, 12, 12, 12, 12, 12, 14, 14, 14, 14, 14, 14, 14, 14},
    {13, 13, 13, 13, 13, 13, 13, 13, 15, 15, 15, 15, 15, 15, 15, 15}};

// Whole 128-k chunks [c0, c1) of a segment of runs from r0 = 4 * c0 (at most four), into tot.
// With VNNI the high nibbles are multiplied where they sit (byte & 0xF0: 16 times the value; vpdpbusd
// sums its products in int32 without saturating), their runs' scales divided by 16 (exact: a power of
// two): one instruction a load fewer than shifting them down (the kernel is arithmetic-bound).
#if defined(__AVX512VNNI__)
constexpr bool HIGH_IN_PLACE = true;
#else
constexpr bool HIGH_IN_PLACE = false;  // vpmaddubsw's int16 pair sums would saturate
#endif

template <int MM>
__attribute__((always_inline)) inline void chunks(const RowArgs& a, int64_t c0, int64_t c1, const __m512 (&sc)[MM],
                                                  const __m512 (&sc_hi)[MM], __m512 (&tot)[MM][2]) {
  const __m512i nib = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  for (int64_t c = c0; c < c1; ++c) {
    _mm_prefetch(reinterpret_cast<const char*>(a.p + c * 64 + TM_I8_PREFETCH), TM_I8_HINT);
    const __m512i w = _mm512_loadu_si512(a.p + c * 64);
    const __m512i lo = _mm512_and_si512(w, nib);
    const __m512i hi = HIGH_IN_PLACE ? _mm512_and_si512(w, high) : _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
    const __m512i lo_idx = _mm512_load_si512(RUN_LANES[2 * (c - c0)]), hi_idx = _mm512_load_si512(RUN_LANES[2 * (c - c0) + 1]);
    for (int m = 0; m < MM; ++m) {
      const int8_t* x = a.xq + m * a.K + c * 128;
      const __m512i dlo = dot512(lo, _mm512_loadu_si512(x)), dhi = dot512(hi, _mm512_loadu_si512(x + 64));
      tot[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dlo), _mm512_permutexvar_ps(lo_idx, sc[m]), tot[m][0]);
      tot[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dhi), _mm512_permutexvar_ps(hi_idx, sc_hi[m]), tot[m][1]);
    }
  }
}

// Runs r0 .. r0 + count - 1 (count <= 16) of the weight row against MM x rows, into tot; G32: groups of
// 32 (one scale a run, read straight from the row's float16 values).
template <int MM, bool G32>
__attribute__((always_inline)) inline void segment(const RowArgs& a, int64_t r0, int count, __m512 (&tot)[MM][2]) {
  const int64_t K = a.K, R = K / RUN, whole = K / 128;
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  __m512 sw, mw;
  if (G32 && count == 16) {
    sw = a.s32 ? _mm512_loadu_ps(a.s32 + r0) : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.s + r0)));
    mw = a.mn32 ? _mm512_loadu_ps(a.mn32 + r0) : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.mn + r0)));
  } else {
    sw = per_run(a.s, a.s32, r0, count, a.shift), mw = per_run(a.mn, a.mn32, r0, count, a.shift);
  }
  __m512 sc[MM], sc_hi[MM];  // scale(w) * scale(x) of each run; for the high nibbles (see chunks)
  for (int m = 0; m < MM; ++m) {
    sc[m] = _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(mask, a.xs + m * R + r0));
    sc_hi[m] = HIGH_IN_PLACE ? _mm512_mul_ps(sc[m], _mm512_set1_ps(0.0625f)) : sc[m];
    tot[m][1] = _mm512_fmadd_ps(mw, _mm512_maskz_loadu_ps(mask, a.xsum + m * R + r0), tot[m][1]);
  }
  if (count == 16) return chunks<MM>(a, r0 / 4, r0 / 4 + 4, sc, sc_hi, tot);
  chunks<MM>(a, r0 / 4, std::min(whole, (r0 + count) / 4), sc, sc_hi, tot);
  // the tail past the whole chunks (the row's last runs): a block of 64 k, then one of 32
  int64_t k = whole * 128;
  int lane = static_cast<int>(whole * 4 - r0);
  if (K - k >= 64) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.p + k / 2));
    const __m256i n4 = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(w, n4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), n4);
    for (int m = 0; m < MM; ++m) {
      const int8_t* x = a.xq + m * K + k;
      const __m256 slo = _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_set1_epi32(lane), sc[m]));
      const __m256 shi = _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_set1_epi32(lane + 1), sc[m]));
      const __m256i dlo = dot256(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
      const __m256i dhi = dot256(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32)));
      const __m256 part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dhi), shi, _mm256_mul_ps(_mm256_cvtepi32_ps(dlo), slo));
      tot[m][0] = _mm512_add_ps(tot[m][0], _mm512_zextps256_ps512(part));
    }
    k += 64, lane += 2;
  }
  if (K - k == 32) {
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.p + k / 2));
    const __m128i n4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(w, n4), hi = _mm_and_si128(_mm_srli_epi16(w, 4), n4);
    for (int m = 0; m < MM; ++m) {
      const int8_t* x = a.xq + m * K + k;
      const __m128i d = _mm_add_epi32(dot128(lo, _mm_loadu_si128(reinterpret_cast<const __m128i*>(x))),
                                      dot128(hi, _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16))));
      const __m128 s = _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set1_epi32(lane), sc[m]));
      tot[m][0] = _mm512_add_ps(tot[m][0], _mm512_zextps128_ps512(_mm_mul_ps(_mm_cvtepi32_ps(d), s)));
    }
  }
}

// The weight row against MM x rows: parts[m][lane] = the row's products with x row m, 16 partial sums.
template <int MM, bool G32>
__attribute__((always_inline)) inline void int4_row(const RowArgs& a, __m512* parts, int64_t stride) {
  const int64_t R = a.K / RUN;
  __m512 tot[MM][2];
  for (int m = 0; m < MM; ++m) tot[m][0] = tot[m][1] = _mm512_setzero_ps();
  int64_t r0 = 0;
  for (; r0 + 16 <= R; r0 += 16) segment<MM, G32>(a, r0, 16, tot);
  if (r0 < R) segment<MM, G32>(a, r0, static_cast<int>(R - r0), tot);
  for (int m = 0; m < MM; ++m) parts[m * stride] = _mm512_add_ps(tot[m][0], tot[m][1]);
}

// Lane i of the result = the sum of v[i]'s 16 lanes (16 weight rows' partial sums reduced together:
// 45 instructions where one row at a time took 8 each, and one vector store for 16 outputs).
inline __m512 reduce16(const __m512* v) {
  __m512 x[8], y[4], w[2];
  for (int i = 0; i < 8; ++i)  // each 128-bit block: rows 2i, 2i + 1, 2i, 2i + 1
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j)  // each block: rows 4j .. 4j + 3
    y[j] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0x44), _mm512_shuffle_ps(x[2 * j], x[2 * j + 1], 0xEE));
  for (int k = 0; k < 2; ++k)  // blocks 0-1: rows 8k .. 8k + 3, blocks 2-3: rows 8k + 4 .. 8k + 7
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], 0x88), _mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2: 64 k (one block, two runs) a load, x in natural order; the runs' scales as scalars
template <int MM, bool G32>
inline void int4_row(const RowArgs& a, float* sums) {
  const int64_t K = a.K, R = K / RUN, full = K / 64 * 64;
  const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 tot[MM][2];
  float mins_part[MM] = {};
  for (int m = 0; m < MM; ++m) tot[m][0] = tot[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < full; k += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(a.p + k / 2 + TM_I8_PREFETCH), TM_I8_HINT);
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.p + k / 2));
    const __m256i lo = _mm256_and_si256(w, nib), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
    const int64_t r = k / RUN;
    const float s_lo = scale_at(a, r >> a.shift), s_hi = scale_at(a, (r + 1) >> a.shift);
    const float m_lo = min_at(a, r >> a.shift), m_hi = min_at(a, (r + 1) >> a.shift);
    for (int m = 0; m < MM; ++m) {
      const int8_t* x = a.xq + m * K + k;
      const __m256i dlo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), ones);
      const __m256i dhi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32))), ones);
      const float* xs = a.xs + m * R + r;
      tot[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dlo), _mm256_set1_ps(s_lo * xs[0]), tot[m][0]);
      tot[m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dhi), _mm256_set1_ps(s_hi * xs[1]), tot[m][1]);
      mins_part[m] += m_lo * a.xsum[m * R + r] + m_hi * a.xsum[m * R + r + 1];
    }
  }
  if (full < K) {  // the last block of 32: one run
    const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.p + full / 2));
    const __m128i n4 = _mm_set1_epi8(0x0F);
    const __m256i both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(w, 4), n4), _mm_and_si128(w, n4));
    const int64_t r = full / RUN;
    const float s = scale_at(a, r >> a.shift), mn = min_at(a, r >> a.shift);
    for (int m = 0; m < MM; ++m) {
      const __m256i d = _mm256_madd_epi16(
          _mm256_maddubs_epi16(both, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + m * K + full))), ones);
      tot[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(s * a.xs[m * R + r]), tot[m][0]);
      mins_part[m] += mn * a.xsum[m * R + r];
    }
  }
  for (int m = 0; m < MM; ++m) sums[m] = hsum8(_mm256_add_ps(tot[m][0], tot[m][1])) + mins_part[m];
}
#else
// other instruction sets: scalar, one run at a time
template <int MM, bool G32>
inline void int4_row(const RowArgs& a, float* sums) {
  const int64_t K = a.K, R = K / RUN;
  for (int m = 0; m < MM; ++m) sums[m] = 0.f;
  for (int64_t r = 0; r < R; ++r) {
    const float s = scale_at(a, r >> a.shift), mn = min_at(a, r >> a.shift);
    for (int m = 0; m < MM; ++m) {
      int32_t dot = 0;
      for (int64_t i = 0; i < RUN; ++i) dot += nibble(a.p, K, r * RUN + i) * a.xq[m * K + r * RUN + i];
      sums[m] += s * a.xs[m * R + r] * static_cast<float>(dot) + mn * a.xsum[m * R + r];
    }
  }
}
#endif

template <typename T>
void int4_impl(at::Tensor& out, const T* x, int64_t x_row, int64_t M, const at::Tensor& packed,
               const at::Tensor& scales, const at::Tensor& mins, int64_t group, const T* bias) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2, G = K / group, R = K / RUN;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * R), xsum(M * R);
  quantize_runs(x, x_row, M, K, xq.data(), xs.data(), xsum.data());
  const int shift = std::countr_zero(static_cast<uint64_t>(group)) - 5;
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const bool scales32 = scales.scalar_type() == at::kFloat;
  const uint16_t* sp = scales32 ? nullptr : reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const float* sp32 = scales32 ? scales.data_ptr<float>() : nullptr;
  const bool mins32 = mins.scalar_type() == at::kFloat;
  const uint16_t* mp = mins32 ? nullptr : reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  const float* mp32 = mins32 ? mins.data_ptr<float>() : nullptr;
  T* y = out.data_ptr<T>();
  const int64_t y_row = out.stride(0);
  // (1 << 16) / K rows: ~32 KB of weights a thread at least (a 512 x 512 layer on both threads: 5.9 µs a call, 6.7 on one)
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / K);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
      const int64_t mm = std::min(MAX_ROWS, M - m0);
      RowArgs a{nullptr, nullptr, nullptr, nullptr, nullptr, shift, K, xq.data() + m0 * K, xs.data() + m0 * R, xsum.data() + m0 * R};
#if defined(TM_INT4_512)
      // 16 weight rows at a time, their sums reduced together
      const auto rows = [&]<int MM, bool G32>() {
        __m512 parts[MM][16];
        alignas(64) float sums16[16];
        for (int64_t n0 = begin; n0 < end; n0 += 16) {
          const int64_t nb = std::min<int64_t>(16, end - n0);
          for (int64_t i = 0; i < nb; ++i) {
            const int64_t n = n0 + i;
            a.p = pp + n * (K / 2), a.s = sp ? sp + n * G : nullptr, a.s32 = sp32 ? sp32 + n * G : nullptr;
            a.mn = mp ? mp + n * G : nullptr, a.mn32 = mp32 ? mp32 + n * G : nullptr;
            int4_row<MM, G32>(a, &parts[0][i], 16);
          }
          for (int m = 0; m < MM; ++m) {
            for (int64_t i = nb; i < 16; ++i) parts[m][i] = _mm512_setzero_ps();
            _mm512_store_ps(sums16, reduce16(parts[m]));
            for (int64_t i = 0; i < nb; ++i) sums16[i] += bias ? static_cast<float>(bias[n0 + i]) : 0.f;
            from_float_row(sums16, y + (m0 + m) * y_row + n0, nb);
          }
        }
      };
#else
      const auto rows = [&]<int MM, bool G32>() {
        float sums[MAX_ROWS];
        for (int64_t n = begin; n < end; ++n) {
          a.p = pp + n * (K / 2), a.s = sp ? sp + n * G : nullptr, a.s32 = sp32 ? sp32 + n * G : nullptr;
            a.mn = mp ? mp + n * G : nullptr, a.mn32 = mp32 ? mp32 + n * G : nullptr;
          int4_row<MM, G32>(a, sums);
          const float b = bias ? static_cast<float>(bias[n]) : 0.f;
          for (int64_t m = 0; m < MM; ++m) y[(m0 + m) * y_row + n] = from_float<T>(sums[m] + b);
        }
      };
#endif
      with_rows<8>(mm, [&]<int MM>() {
        if (shift == 0)
          rows.template operator()<MM, true>();
        else
          rows.template operator()<MM, false>();
      });
    }
  });
}

}  // namespace

namespace tokenmill {

// out [M, N] = x [M, K] @ W^T (+ bias), W as packed [N, K / 2] (uint8, the layout above), scales and mins
// [N, K / group] (each float16 or float32).
void linear_int4(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                 const at::Tensor& mins, int64_t group, const c10::optional<at::Tensor>& bias, bool amx) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_int4: x must be [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte &&
                  packed.size(1) * 2 == K && K % 32 == 0,
              "linear_int4: packed must be contiguous uint8 [N, K / 2] for x [M, K], K a multiple of 32");
    TORCH_CHECK(group >= 32 && group <= 4096 && (group & (group - 1)) == 0 && K % group == 0,
              "linear_int4: group must be a power of two from 32 to 4096 dividing K, got ", group);
  const int64_t N = packed.size(0);
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kHalf || t->scalar_type() == at::kFloat,
                "linear_int4: scales and mins must be float16 or float32");
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->dim() == 2 && t->is_contiguous() && t->size(0) == N &&
                    t->size(1) == K / group,
                "linear_int4: scales and mins must be contiguous [N, K / group]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == M && out.size(1) == N,
              "linear_int4: out must be [M, N] with contiguous rows");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  out.scalar_type() == x.scalar_type(),
              "linear_int4: x and out float32 or bfloat16, one dtype");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                                     bias->numel() == N),
              "linear_int4: bias must be contiguous [N] in x's dtype");
  if (M == 0 || N == 0) return;
  if (amx) {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_int4: the AMX mode takes bfloat16 x");
    int64_t done = 0;
#if defined(TM_AMX)
    // the weights dequantized 32 k of a row at a time (q * scale + min: one group a step) into bfloat16 tiles
    const uint8_t* pp = packed.data_ptr<uint8_t>();
    const bool scales32 = scales.scalar_type() == at::kFloat;
    const uint16_t* sp = scales32 ? nullptr : reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
    const float* sp32 = scales32 ? scales.data_ptr<float>() : nullptr;
    const bool mins32 = mins.scalar_type() == at::kFloat;
    const uint16_t* mp = mins32 ? nullptr : reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
    const float* mp32 = mins32 ? mins.data_ptr<float>() : nullptr;
    const int64_t G = K / group, full = K / 64 * 64;
    const int shift = std::countr_zero(static_cast<uint64_t>(group));
    bf16* y = out.data_ptr<bf16>();
    const bf16* b = bias ? bias->data_ptr<bf16>() : nullptr;
    const int64_t y_row = out.stride(0);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const auto rows = [&](int64_t n, int64_t k) {
      const uint8_t* row = pp + n * (K / 2);
      __m128i lo, hi;  // the 32 values, k 0-15 and 16-31
      if (k < full) {  // a run of a 64-k block: low nibbles for its first 32 k, high for the last
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k / 64 * 32));
        const __m256i v = k % 64 == 0 ? _mm256_and_si256(bytes, _mm256_set1_epi8(0x0F))
                                      : _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(0x0F));
        lo = _mm256_castsi256_si128(v);
        hi = _mm256_extracti128_si256(v, 1);
      } else {  // the last block of 32
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + full / 2));
        lo = _mm_and_si128(bytes, mask);
        hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
      }
      const int64_t g = n * G + (k >> shift);
      const __m512 s = _mm512_set1_ps(sp32 ? sp32[g] : _cvtsh_ss(sp[g]));
      const __m512 m = _mm512_set1_ps(mp32 ? mp32[g] : _cvtsh_ss(mp[g]));
      const __m512 flo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), s, m);
      const __m512 fhi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), s, m);
      return tm_amx::to_bf16x32(flo, fhi);
    };
    done = tm_amx::linear_rows_bf16(x.data_ptr<bf16>(), x.stride(0), M, N, K, rows, [&](int64_t mi, int64_t n, float sum) {
      y[mi * y_row + n] = from_float<bf16>(sum + (b ? static_cast<float>(b[n]) : 0.f));
    });
#endif
    if (done < N) {  // the rows short of a block (or no tiles): one weight row at a time
      const c10::optional<at::Tensor> rest_bias = bias ? c10::optional<at::Tensor>(bias->narrow(0, done, N - done)) : bias;
      linear_int4(out.narrow(1, done, N - done), x, packed.narrow(0, done, N - done), scales.narrow(0, done, N - done),
                  mins.narrow(0, done, N - done), group, rest_bias, false);
    }
    return;
  }
  if (x.scalar_type() == at::kFloat)
    int4_impl<float>(out, x.data_ptr<float>(), x.stride(0), M, packed, scales, mins, group,
                     bias ? bias->data_ptr<float>() : nullptr);
  else
    int4_impl<bf16>(out, x.data_ptr<bf16>(), x.stride(0), M, packed, scales, mins, group,
                    bias ? bias->data_ptr<bf16>() : nullptr);
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def(
      "linear_int4(Tensor(a!) out, Tensor x, Tensor packed, Tensor scales, Tensor mins, int group, Tensor? bias, "
      "bool amx) -> ()");
  m.impl("linear_int4", c10::DispatchKey::CPU, &tokenmill::linear_int4);
}

// Linear layers on the CPU: y [M, N] = x [M, K] @ w[N, K]^T (+ bias), decode batches and prompt chunks,
// the weight read in its checkpoint layout [N, K] (no repacking: the same tensor serves torch's GEMM
// where the tuned plan prefers it). Each thread takes a contiguous range of output rows. Up to 8 x
// rows walk them one weight row at a time, two up to 4 x rows (`rows_one_by_one`: one sequential
// weight stream a thread); on AVX2, 5-8 x rows (bfloat16 weights: 5-10) walk them in K slices that
// keep x in L1 (linear_kblock.h). More rows run R x MB dot-product tiles, cache-blocked
// (`rows_blocked`), except from 16 rows on (AVX2 bfloat16: 13) on AVX2 and for float32 weights on
// AVX-512, where the outer-product tiles of linear_broadcast.h run instead.
// float32 weights: FMA over 16 (AVX-512) or 8 (AVX2) lanes. bfloat16 weights: vdpbf16ps (AVX-512
// BF16: pairs of bfloat16 products summed into float32 lanes) where the CPU has it, else widened to
// float32 by a shift against x widened once per call. Sums in float32; the output rounded once to its
// dtype, as torch's GEMM does.
// Without AVX2 the same loops run on scalars (the build is for the CPU at hand: -march=native).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "convert.h"
#include "int_dot.h"  // (tm_int::with_rows: a run-time row count to a compiled one)
#include "linear_amx.h"
#include "linear_broadcast.h"
#include "ops.h"

namespace {

constexpr int R = 4;   // weight rows per group
// x rows per pass over a group. AVX-512: 4 x 6 accumulators + 6 x vectors + 1 weight vector fill the
// 32 registers; faster than 4 x 4 at 16-64 rows (fewer loads per FMA). AVX2 has 16 registers:
// 4 x 3 + 3 + 1; 4 x 2 measured slower at 16-256 rows (benchmarks/linear_variants.py).
#ifndef TM_MB
#if defined(__AVX512F__)
#define TM_MB 6
#else
#define TM_MB 3
#endif
#endif
constexpr int MB = TM_MB;
// weights are prefetched this many row groups ahead, with this hint: into L2 (T1), two groups ahead.
// Measured against L1 (T0) one group ahead, float32 weights on 2 MB pages, every product of a step
// interleaved: faster at 4 and 8 rows, alike at 1 and 16 rows and in bfloat16 (on 4 KB pages, 0-8
// groups into L1 were all alike).
// Both macros exist only for side-by-side builds (benchmarks/linear_variants.py).
#ifndef TM_PREFETCH_GROUPS
#define TM_PREFETCH_GROUPS 2
#endif
#ifndef TM_PREFETCH_HINT
#define TM_PREFETCH_HINT _MM_HINT_T1
#endif
constexpr int PREFETCH_GROUPS = TM_PREFETCH_GROUPS;

using bf16 = c10::BFloat16;

// Lanes: the widest float32 vector this build has, and the ops the loops need on it.
#if defined(__AVX512F__)
struct Lanes {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V load(const bf16* p) {  // 16 bfloat16 -> float32 by a 16-bit shift
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Lanes {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V load(const bf16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) { return hsum8(v); }
};
#else
struct Lanes {
  using V = float;
  static constexpr int W = 1;
  static V zero() { return 0.f; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V load(const bf16* p) { return static_cast<float>(*p); }
  static V fma(V a, V b, V c) { return a * b + c; }
  static float sum(V v) { return v; }
};
#endif

#if defined(__AVX512F__)
// The 16 lane sums of in[0..15] as one vector (in order), by a shuffle tree: ~3 instructions a sum
// where one reduction each takes ~8 (measured faster at 16-64 float32 rows).
inline __m512 sum16(const __m512* in) {
  __m512 v[8], w[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3) of a = in[2i], b = in[2i+1]
    v[i] = _mm512_add_ps(_mm512_unpacklo_ps(in[2 * i], in[2 * i + 1]), _mm512_unpackhi_ps(in[2 * i], in[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // per lane: the lane's sums of in[4j..4j+3]
    const __m512d a = _mm512_castps_pd(v[2 * j]), b = _mm512_castps_pd(v[2 * j + 1]);
    w[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // across the four lanes: lanes (0, 2) + (1, 3), twice
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x88), _mm512_shuffle_f32x4(w[2], w[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}

#define TM_TREE sum16
#elif defined(__AVX2__) && defined(__FMA__)
// The 8 lane sums of in[0..7] as one vector (in order): 6 horizontal adds, 2 lane swaps and an add
// where one reduction each takes 5 instructions.
inline __m256 sum8(const __m256* in) {
  // per 128-bit half: the half's four sums of in[0..3] (ab) and of in[4..7] (cd)
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(in[0], in[1]), _mm256_hadd_ps(in[2], in[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(in[4], in[5]), _mm256_hadd_ps(in[6], in[7]));
  // low halves + high halves
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}
#define TM_TREE sum8
#endif

#if defined(TM_TREE)
// out[r * OS + m] = the lane sum of acc[r][m]: whole runs of Lanes::W by the shuffle tree (in acc's
// order), the rest one by one. OS >= MM: the row stride of `out`.
template <int RR, int MM, int OS>
inline void store_sums(const typename Lanes::V (&acc)[RR][MM], float* out) {
  constexpr int n = RR * MM;
  const typename Lanes::V* flat = &acc[0][0];
  float sums[n];
  int i = 0;
  for (; i + Lanes::W <= n; i += Lanes::W) Lanes::store(sums + i, TM_TREE(flat + i));
  for (; i < n; ++i) sums[i] = Lanes::sum(flat[i]);
  for (int r = 0; r < RR; ++r)
    for (int m = 0; m < MM; ++m) out[r * OS + m] = sums[r * MM + m];
}
#else
template <int RR, int MM, int OS>
inline void store_sums(const typename Lanes::V (&acc)[RR][MM], float* out) {
  for (int r = 0; r < RR; ++r)
    for (int m = 0; m < MM; ++m) out[r * OS + m] = Lanes::sum(acc[r][m]);
}
#endif

// acc[r][m] = sum over k < K of w[r][k] * x[m][k], for RR weight rows and MM x rows (compile-time
// counts, so the accumulators stay in registers). Returns the float32 sums in out[r * OS + m]: the
// blocked tiles' row stride is MB; a caller with more x rows than MB (the few-row path's 2 x 4 tile
// on AVX2, where MB is 3) passes its own, or the rows' sums would overlap.
// x is in the weights' dtype T, or float32 (bfloat16 weights without the BF16 dot instruction).
template <int RR, int MM, int OS = MB, typename T, typename X>
inline void dot_tile(const T* w, int64_t w_row, int64_t K, const X* x, int64_t x_row, float* out) {
  int64_t k = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<X, bf16>) {  // 32 bfloat16 per step, pairs summed by the instruction
    __m512 acc[RR][MM];
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_setzero_ps();
    for (; k + 32 <= K; k += 32) {
      __m512bh xv[MM];
      for (int m = 0; m < MM; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * x_row + k);
      for (int r = 0; r < RR; ++r) {
        // the same place in the next group's rows (a prefetch past the end is a hint, not an access)
        _mm_prefetch(reinterpret_cast<const char*>(w + (r + PREFETCH_GROUPS * R) * w_row + k), TM_PREFETCH_HINT);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * w_row + k);
        for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
      }
    }
    store_sums<RR, MM, OS>(acc, out);
  } else
#endif
  {
    typename Lanes::V acc[RR][MM];
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < MM; ++m) acc[r][m] = Lanes::zero();
    // one step: W lanes of k against every row of the tile (a macro, not a lambda capturing acc: see
    // linear_broadcast.h for what GCC made of that there)
#define TM_DOT_STEP(kk)                                                                     \
  {                                                                                         \
    typename Lanes::V xv[MM];                                                               \
    for (int m = 0; m < MM; ++m) xv[m] = Lanes::load(x + m * x_row + (kk));                 \
    for (int r = 0; r < RR; ++r) {                                                          \
      const typename Lanes::V wv = Lanes::load(w + r * w_row + (kk));                       \
      for (int m = 0; m < MM; ++m) acc[r][m] = Lanes::fma(wv, xv[m], acc[r][m]);            \
    }                                                                                       \
  }
#ifdef TM_PREFETCH_EVERY_STEP
    constexpr int64_t per_line = 1;
#else
    constexpr int64_t per_line = std::max<int64_t>(1, 64 / (Lanes::W * sizeof(T)));  // steps per weight cache line
#endif
    for (; k + per_line * Lanes::W <= K; k += per_line * Lanes::W) {
      // the same place in the next group's rows, once per cache line (a prefetch past the end is a
      // hint, not an access)
      for (int r = 0; r < RR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (r + PREFETCH_GROUPS * R) * w_row + k), TM_PREFETCH_HINT);
      for (int64_t u = 0; u < per_line; ++u) TM_DOT_STEP(k + u * Lanes::W)
    }
    for (; k + Lanes::W <= K; k += Lanes::W) TM_DOT_STEP(k)
#undef TM_DOT_STEP
    store_sums<RR, MM, OS>(acc, out);
  }
  for (; k < K; ++k)  // the tail shorter than a vector
    for (int r = 0; r < RR; ++r)
      for (int m = 0; m < MM; ++m)
        out[r * OS + m] += static_cast<float>(w[r * w_row + k]) * static_cast<float>(x[m * x_row + k]);
}

// More than seq_rows x rows (AVX2: up to 15, bfloat16 11-12; the outer-product tiles of linear_broadcast.h
// take the rest): arithmetic more than weight reads, so the loops keep each operand in the cache level it is
// reused from. A thread's weight rows go NB at a time (the block stays in L2: NB x KC weights); for
// each K slice of KC, x goes MC rows at a time (a slice of them stays in L1), and each group of R
// weight rows of the block meets those x rows MB at a time in registers. The float32 partial sums of
// the block live in `acc` [M, NB] until the last K slice. Against the unblocked loops, on AVX2:
// alike at 16-64 rows, faster at 256 (the tile's own loop, not the caches, holds it well under the
// FMA peak there); not yet timed on AVX-512.
#ifndef TM_KC
#define TM_KC 512  // the block sizes are macros only for side-by-side builds (benchmarks/linear_variants.py)
#endif
#ifndef TM_NB
#define TM_NB 64
#endif
#ifndef TM_MC
#define TM_MC (2 * MB)
#endif
constexpr int64_t KC = TM_KC, NB = TM_NB, MC = TM_MC;
static_assert(NB % R == 0, "weight blocks hold whole row groups");

// acc[m * acc_row + r] += the tile's sums, for rr weight rows and mm x rows (run-time counts, one
// compiled tile per pair).
template <typename T, typename X>
inline void add_tile(int rr, int mm, const T* w, int64_t w_row, int64_t K, const X* x, int64_t x_row, float* acc,
                     int64_t acc_row) {
  float sums[R * MB];
  // the tile for (RR, MM) at compile time
  const auto run = [&]<int RR, int MM>() {
    dot_tile<RR, MM>(w, w_row, K, x, x_row, sums);
    for (int m = 0; m < MM; ++m)
      for (int r = 0; r < RR; ++r) acc[m * acc_row + r] += sums[r * MB + m];
  };
  const auto rows = [&]<int RR>() {
    switch (mm) {  // mm <= MB
      case 6: if constexpr (MB >= 6) run.template operator()<RR, 6>(); break;
      case 5: if constexpr (MB >= 5) run.template operator()<RR, 5>(); break;
      case 4: if constexpr (MB >= 4) run.template operator()<RR, 4>(); break;
      case 3: if constexpr (MB >= 3) run.template operator()<RR, 3>(); break;
      case 2: run.template operator()<RR, 2>(); break;
      default: run.template operator()<RR, 1>(); break;
    }
  };
  switch (rr) {
    case 4: rows.template operator()<4>(); break;
    case 3: rows.template operator()<3>(); break;
    case 2: rows.template operator()<2>(); break;
    default: rows.template operator()<1>(); break;
  }
}

#include "linear_kblock.h"  // (uses Lanes and store_sums)

// y[:, n_begin:n_end] for x [M, K] (M > seq_rows), blocked as above.
template <typename T, typename X>
void rows_blocked(const T* wp, const T* bias, int64_t n_begin, int64_t n_end, int64_t K, const X* x,
                  int64_t x_row, int64_t M, T* y, int64_t y_row) {
  std::vector<float> acc(M * NB);  // [M, nn] for the block at hand
  for (int64_t nb = n_begin; nb < n_end; nb += NB) {
    const int64_t nn = std::min(NB, n_end - nb);
    std::fill(acc.begin(), acc.begin() + M * nn, 0.f);
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      for (int64_t mc = 0; mc < M; mc += MC) {
        const int64_t m_end = std::min(M, mc + MC);
        for (int64_t j = 0; j < nn; j += R) {
          const int rr = static_cast<int>(std::min<int64_t>(R, nn - j));
          // x rows MB at a time; a remainder past MB split in two (16 rows on AVX2: 3+3+3+3+2+2, not
          // ... +3+1, whose one-row tile does four FMAs per five loads)
          for (int64_t m0 = mc; m0 < m_end;) {
            const int64_t left = m_end - m0;
            const int mm = static_cast<int>(left > 2 * MB ? MB : left > MB ? (left + 1) / 2 : left);
            add_tile(rr, mm, wp + (nb + j) * K + k0, K, kc, x + m0 * x_row + k0, x_row, acc.data() + m0 * nn + j, nn);
            m0 += mm;
          }
        }
      }
    }
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < nn; ++j) {
        const float b = bias ? static_cast<float>(bias[nb + j]) : 0.f;
        y[m * y_row + nb + j] = from_float<T>(acc[m * nn + j] + b);
      }
  }
}

// Few x rows (M <= seq_rows): one weight row at a time against all of them, so each thread reads its
// weights as one sequential stream. Four interleaved row streams (the 4-row tile) defeat the hardware
// prefetcher on short rows: one stream reads the weights faster or as fast at 1-8 rows, on AVX-512
// and on AVX2 (benchmarks/linear_variants.py, results/linear_variants*.json). Up to 4 x rows, two
// weight rows go together (two streams: twice the independent sums and half the x loads a weight
// vector): float32 decode steps at 1 and 4 sequences measured faster than one row at a time (two
// processes each way, alternated); bfloat16 alike; at 8 rows two streams lose.
#ifndef TM_SEQ_ROWS
#if defined(__AVX512F__)
#define TM_SEQ_ROWS 8
#else
// AVX2, bfloat16 weights up to 10 rows: 9-10 rows in the K-sliced walk (linear_kblock.h) took 0.85-0.92x
// the time of the blocked tiles on Zen 3; 11-12 rows alike or slower (results/dense_rows_zen3_batch_rows*.json).
// float32 weights (not timed at 9-10 rows) keep 8.
#define TM_SEQ_ROWS 10
#endif
#endif
// the few-row path's last row count for weights of type T
template <typename T>
constexpr int64_t seq_rows = std::is_same_v<T, bf16> ? TM_SEQ_ROWS : std::min(TM_SEQ_ROWS, 8);
static_assert(seq_rows<bf16> <= 15 && (seq_rows<bf16> <= 8 || KBLOCK_MIN <= 9), "9-15 rows: only the K-sliced walk");

template <int MM, typename T, typename X>
inline void rows_one_by_one(const T* w, const T* bias, int64_t n0, int64_t rows, int64_t K, const X* x,
                            int64_t x_row, T* y, int64_t y_row) {
  float sums[2 * MM];
  int64_t r = 0;
  for (; MM <= 4 && r + 2 <= rows; r += 2) {
    dot_tile<2, MM, MM>(w + r * K, K, K, x, x_row, sums);  // (row stride MM: MB may be smaller)
    for (int rr = 0; rr < 2; ++rr) {
      const float b = bias ? static_cast<float>(bias[n0 + r + rr]) : 0.f;
      for (int m = 0; m < MM; ++m) y[m * y_row + n0 + r + rr] = from_float<T>(sums[rr * MM + m] + b);
    }
  }
  for (; r < rows; ++r) {
    dot_tile<1, MM, MM>(w + r * K, K, K, x, x_row, sums);
    const float b = bias ? static_cast<float>(bias[n0 + r]) : 0.f;
    for (int m = 0; m < MM; ++m) y[m * y_row + n0 + r] = from_float<T>(sums[m] + b);
  }
}

// x [M, K] (row stride x_row) in X, weight [N, K] and out in T.
template <typename T, typename X>
void linear_impl(at::Tensor& out, const X* xp, int64_t x_row, int64_t M, const at::Tensor& weight,
                 const c10::optional<at::Tensor>& b) {
  const T* bias = b.has_value() ? b->data_ptr<T>() : nullptr;
  const int64_t K = weight.size(1), N = weight.size(0);
  const T* wp = weight.data_ptr<T>();
  T* yp = out.data_ptr<T>();
  const int64_t y_row = out.stride(0);
#if defined(TM_BROADCAST_TILES)
  if constexpr (std::is_same_v<X, float>) {  // on AVX2, bfloat16 x comes widened: always
#ifndef TM_BROADCAST_MIN
// bfloat16 from 13 rows: a panel of 16 with 13-15 real rows took 0.87-0.92x the time of the dot-product tiles
// (bfloat16, the 1.1B model's products, Zen 3: results/dense_rows_zen3_batch_rows2.json)
#define TM_BROADCAST_MIN 13
#endif
    // AVX2, 13 rows and more (float32 weights, not timed at 13-15: 16): outer-product tiles (linear_broadcast.h)
    if (M >= (std::is_same_v<T, bf16> ? TM_BROADCAST_MIN : tm_broadcast::MP)) {
      const int64_t done = tm_broadcast::linear(xp, x_row, M, wp, N, K, bias, yp, y_row);
      if (done < N) rows_blocked(wp, bias, done, N, K, xp, x_row, M, yp, y_row);  // the rows short of a tile
      return;
    }
  }
#endif
#if defined(TM_AMX)
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<X, bf16>) {
    if (M >= tm_amx::MIN_ROWS && M <= tm_amx::MAX_ROWS) {  // AMX tiles (linear_amx.h), where granted
      const int64_t done = tm_amx::linear(xp, x_row, M, wp, N, K, bias, yp, y_row);
      if (done > 0) {
        if (done < N) rows_blocked(wp, bias, done, N, K, xp, x_row, M, yp, y_row);  // the rows short of a block
        return;
      }
    }
  }
#endif
#if defined(TM_BROADCAST_TILES_512)
  if constexpr (std::is_same_v<T, float>) {
    if (M >= tm_broadcast512::MIN_ROWS) {  // AVX-512, float32: outer-product tiles (linear_broadcast.h)
      const int64_t done = tm_broadcast512::linear(xp, x_row, M, wp, N, K, bias, yp, y_row);
      if (done < N) rows_blocked(wp, bias, done, N, K, xp, x_row, M, yp, y_row);  // the rows short of a tile
      return;
    }
  }
#endif
  const int64_t groups = (N + R - 1) / R;
  // a thread's share is at least ~64K weights (128-256 KB): below that, forking costs more than it saves
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (R * K));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    if (M <= seq_rows<T>) {
      const int64_t n0 = begin * R, rows = std::min<int64_t>(end * R, N) - n0;
      const T* w = wp + n0 * K;
      if (M >= KBLOCK_MIN)  // x kept in L1 (linear_kblock.h)
        tm_int::with_rows<15>(M, [&]<int MM>() { rows_kblocked<MM>(w, bias, n0, rows, K, xp, x_row, yp, y_row); });
      else  // (M <= 8 here: seq_rows' static_assert)
        tm_int::with_rows<8>(M, [&]<int MM>() { rows_one_by_one<MM>(w, bias, n0, rows, K, xp, x_row, yp, y_row); });
      return;
    }
    rows_blocked(wp, bias, begin * R, std::min<int64_t>(end * R, N), K, xp, x_row, M, yp, y_row);
  });
}

}  // namespace

// The ops' entry points, also called from decode_layer.cpp (declared in ops.h).
namespace tokenmill {

// out [M, N] = x [M, K] @ weight [N, K]^T (+ bias [N]). x rows contiguous (any row stride),
// weight contiguous, one dtype (float32 or bfloat16) for x, weight and out.
void linear(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear: x must be [M, K] with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "linear: weight must be contiguous [N, K] for x [M, K]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              "linear: out must be [M, N] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && out.scalar_type() == x.scalar_type(), "linear: one dtype");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == x.scalar_type() && bias->is_contiguous() &&
                                     bias->numel() == weight.size(0)),
              "linear: bias must be contiguous [N] in x's dtype");
  const int64_t M = x.size(0), K = x.size(1);
  if (M == 0 || weight.size(0) == 0) return;  // nothing to compute (an empty x has no data to point at)
  if (x.scalar_type() == at::kFloat) {
    linear_impl<float>(out, x.data_ptr<float>(), x.stride(0), M, weight, bias);
  } else if (x.scalar_type() == at::kBFloat16) {
#if defined(__AVX512BF16__)
    linear_impl<bf16>(out, x.data_ptr<bf16>(), x.stride(0), M, weight, bias);
#else
    // no bfloat16 dot instruction: x widened to float32 once here rather than once per weight group
    // Up to seq_rows rows, each row padded by TM_X_PAD floats: rows of K = 2048 floats lie 8 KB apart, so
    // the same columns of 8 rows fell in one set of the 8-way L1 and evicted each other (padded by 16,
    // Zen 3, the 1.1B model's products: 0.94x the time at 8 rows, 0.9x at 4; alike at 1-2; at 12 rows
    // 1.02x, so not there: results/dense_rows_zen3_pad*.json).
#ifndef TM_X_PAD
#define TM_X_PAD 16
#endif
    const int64_t xs = K + (M <= seq_rows<bf16> ? TM_X_PAD : 0);
    std::vector<float> xf(M * xs);
    const bf16* xp = x.data_ptr<bf16>();
    for (int64_t m = 0; m < M; ++m) to_float(xp + m * x.stride(0), xf.data() + m * xs, K);
    linear_impl<bf16>(out, xf.data(), xs, M, weight, bias);
#endif
  } else {
    TORCH_CHECK(false, "linear: float32 and bfloat16 only");
  }
}

}  // namespace tokenmill

#ifndef TM_LIB
#define TM_LIB tokenmill_cpu  // another namespace only for side-by-side builds (benchmarks/linear_variants.py)
#endif
TORCH_LIBRARY_FRAGMENT(TM_LIB, m) {
  m.def("linear(Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias) -> ()");
  m.impl("linear", c10::DispatchKey::CPU, &tokenmill::linear);
}

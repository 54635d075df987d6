// Paged attention on the CPU for every sequence of a step (decodes, speculative verification, prompt
// chunks), reading K and V where they lie in the paged cache (written by kv_write.cpp).
//
// Cache layout (one layer): K and V each [num_blocks, num_kv_heads, block_size * head_dim], one
// contiguous chunk per (block, KV head): K's chunk is [head_dim, block_size] (a block's keys side
// by side, so a query's scores against them are 16-wide vector FMAs, no horizontal sums), V's is
// [block_size, head_dim] (each value row added whole). One work item per (sequence, KV head, slice of
// its query positions): tile by tile of 16 keys, the slice's queries (its positions x the query heads
// sharing the KV head, 4 or 8 at a time) read each key and value once, with an online softmax (running
// max and sum, one step per 4 tiles) so no score row is ever stored; a slice reads no key past its
// last query's position.
// Query i of a sequence with L tokens in the cache sits at position L - query_len + i and sees keys
// at positions <= its own (and > its own - window with a sliding window). Arithmetic in float32
// whatever the cache dtype. An int8 cache (`--kv-cache-dtype int8`) holds each token's K and V of a
// head as int8 with one float32 scale (max |x| / 127), in [num_blocks, kv_heads, block_size] beside
// the chunks; keys and values are widened and scaled as a tile is loaded.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "attention_bf16.h"
#include "convert.h"
#include "ops.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kTile = 16;  // keys scored at once: one 16-lane float vector
// Queries sharing each loaded key and value (a GQA group, or query tokens): 4, or 8 where there are
// 32 vector registers and 8 queries to fill them (with AVX2's 16, 8 queries' scores against a tile
// would take every register).
constexpr int64_t kQueries = 4;
#if defined(__AVX512F__)
constexpr int64_t kWideQueries = 8;
#else
constexpr int64_t kWideQueries = 4;
#endif
constexpr int64_t kBatch = 4;  // tiles of keys per softmax update (its max, rescaling and exp batched)
constexpr int64_t kSliceRows = 64;  // query rows (positions x the heads sharing a KV head) a work item

// A work item: KV head kv_head of sequence seq, for its query positions [first, last) (0 = its first
// new token).
struct Slice {
  int64_t seq;
  int64_t kv_head;
  int64_t first;
  int64_t last;
};

// Up to kTile keys and values of one (block, KV head) chunk, as float32, head_dim padded with zeros
// to `width` (a multiple of kTile). keys: [width, kTile] with row stride key_stride; values: `count`
// rows, value_stride apart. The chunk itself for a float32 cache whose blocks are whole tiles and
// whose head_dim is a multiple of kTile; else a zero-padded copy.
struct Tile {
  const float* keys;
  int64_t key_stride;
  const float* values;
  int64_t value_stride;
  int64_t count;
};

// The next batch's K and V chunks (up to kBatch blocks), requested one 64-byte line per call of
// next(), spread through the arithmetic: a burst of a hundred prefetches would stall on the core's
// miss buffers.
struct Prefetch {
  const char* from[2 * kBatch] = {};
  const char* to[2 * kBatch] = {};
  int64_t ranges = 0;
  int64_t at = 0;
  template <typename T>
  void add(const T* chunk, int64_t n) {
    from[ranges] = reinterpret_cast<const char*>(chunk);
    to[ranges] = from[ranges] + n * static_cast<int64_t>(sizeof(T));
    ++ranges;
  }
  inline void next() {
    while (at < ranges && from[at] >= to[at]) ++at;
    if (at < ranges) {
      __builtin_prefetch(from[at]);
      from[at] += 64;
    }
  }
};

template <typename T>
Tile load_tile(const T* k_chunk, const T* v_chunk, int64_t block_size, int64_t first, int64_t count, int64_t dim,
               int64_t width, float* kbuf, float* vbuf) {
  if constexpr (std::is_same_v<T, float>) {
    if (count == kTile && block_size % kTile == 0 && dim == width) {
      return {k_chunk + first, block_size, v_chunk + first * dim, dim, count};
    }
  }
  if (count == kTile && block_size == kTile && dim == width) {  // whole chunks: one widening pass each
    to_float(k_chunk, kbuf, dim * kTile);
    to_float(v_chunk + first * dim, vbuf, kTile * dim);
    return {kbuf, kTile, vbuf, width, count};
  }
  for (int64_t d = 0; d < width; ++d) {
    for (int64_t t = 0; t < kTile; ++t) {
      kbuf[d * kTile + t] = (t < count && d < dim) ? static_cast<float>(k_chunk[d * block_size + first + t]) : 0.f;
    }
  }
  for (int64_t t = 0; t < count; ++t) {
    to_float(v_chunk + (first + t) * dim, vbuf + t * width, dim);
    for (int64_t d = dim; d < width; ++d) vbuf[t * width + d] = 0.f;
  }
  return {kbuf, kTile, vbuf, width, count};
}

// An int8 cache's tile: each key and value widened and multiplied by its token's scale (k_scales and
// v_scales: the chunk's [block_size] scales).
Tile load_tile_int8(const int8_t* k_chunk, const int8_t* v_chunk, const float* k_scales, const float* v_scales,
                    int64_t block_size, int64_t first, int64_t count, int64_t dim, int64_t width, float* kbuf,
                    float* vbuf) {
  for (int64_t d = 0; d < width; ++d) {
    const int8_t* row = k_chunk + d * block_size + first;
#pragma omp simd
    for (int64_t t = 0; t < kTile; ++t)
      kbuf[d * kTile + t] = (t < count && d < dim) ? static_cast<float>(row[t]) * k_scales[first + t] : 0.f;
  }
  for (int64_t t = 0; t < count; ++t) {
    const int8_t* row = v_chunk + (first + t) * dim;
    const float s = v_scales[first + t];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) vbuf[t * width + d] = static_cast<float>(row[d]) * s;
    for (int64_t d = dim; d < width; ++d) vbuf[t * width + d] = 0.f;
  }
  return {kbuf, kTile, vbuf, width, count};
}

// 2^x for x <= 0, vectorizable: x = n + f with n = round(x), |f| <= 1/2, 2^f by a degree-6
// polynomial (its Taylor terms in f ln 2: relative error under 1e-7 on that range), 2^n from the
// exponent bits. Below -126 (and for -inf) it returns ~1e-38 instead of underflowing to 0. Scores
// are kept in base 2 (the queries scaled by log2(e) beside 1 / sqrt(d)), so no multiply goes first.
__attribute__((always_inline)) inline float exp2_nonpositive(float x) {
  x = std::max(x, -126.f);
  const float n = __builtin_rintf(x);
  const float f = x - n;
  float p = 1.5403530393e-4f;
  p = p * f + 1.3333558146e-3f;
  p = p * f + 9.6181291076e-3f;
  p = p * f + 5.5504108665e-2f;
  p = p * f + 2.4022650696e-1f;
  p = p * f + 6.9314718056e-1f;
  p = p * f + 1.f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

constexpr int64_t kKeys = kBatch * kTile;  // keys a softmax step

// The scores of tile i, si[j][t], into row i of s[j] with its hidden keys at -inf (visible[j][i] =
// [lo, hi): query j's keys within tile i).
template <int64_t kQ>
inline void place_scores(const float (*si)[kTile], int64_t i, const int64_t (*visible)[kBatch][2], float (*s)[kKeys]) {
  for (int64_t j = 0; j < kQ; ++j) {
    const int32_t from = static_cast<int32_t>(visible[j][i][0]), to = static_cast<int32_t>(visible[j][i][1]);
    if (from == 0 && to == kTile) {  // the usual case: every key seen
#pragma omp simd
      for (int32_t t = 0; t < kTile; ++t) s[j][i * kTile + t] = si[j][t];
    } else {  // hidden keys score -inf (32-bit lane indices, like the floats')
#pragma omp simd
      for (int32_t t = 0; t < kTile; ++t) s[j][i * kTile + t] = (t >= from && t < to) ? si[j][t] : kNegInf;
    }
  }
}

// One online-softmax step of kQ queries over a batch of n tiles' scores s (in base 2): the batch's
// max, each query's correction of what it summed before, p = 2^(s - max), the lane-wise sums
// (run_sum [kQ, kTile]: added up once, at the end, so no step pays a horizontal sum).
template <int64_t kQ>
inline void softmax_step(float (*s)[kKeys], int64_t n, float* run_max, float* run_sum, float (*p)[kKeys],
                         float* correction) {
  for (int64_t j = 0; j < kQ; ++j)  // the batch's missing tiles: hidden keys
    for (int64_t t = n * kTile; t < kKeys; ++t) s[j][t] = kNegInf;
  for (int64_t j = 0; j < kQ; ++j) {
    float batch_max = kNegInf;
#pragma omp simd reduction(max : batch_max)
    for (int64_t t = 0; t < kKeys; ++t) batch_max = std::max(batch_max, s[j][t]);
    if (batch_max == kNegInf) {  // nothing visible to this query here
      correction[j] = 1.f;
      for (int64_t t = 0; t < kKeys; ++t) p[j][t] = 0.f;
      continue;
    }
    const float new_max = std::max(run_max[j], batch_max);
    correction[j] = exp2_nonpositive(run_max[j] - new_max);  // ~0 on the first visible batch (acc is 0 then)
    run_max[j] = new_max;
    // hidden keys: exp2_nonpositive(-inf) is ~1e-38, nothing beside the max's 1
#pragma omp simd
    for (int64_t t = 0; t < kKeys; ++t) p[j][t] = exp2_nonpositive(s[j][t] - new_max);
    float* sum = run_sum + j * kTile;
#pragma omp simd
    for (int64_t t = 0; t < kTile; ++t) sum[t] *= correction[j];
    for (int64_t i = 0; i < kBatch; ++i) {
#pragma omp simd
      for (int64_t t = 0; t < kTile; ++t) sum[t] += p[j][i * kTile + t];
    }
  }
}

// kQ queries [kQ, dim] (float32, scaled; dim: the padded width) over up to kBatch tiles of keys:
// scores, one softmax step for them all, then the accumulators [kQ, dim] rescaled and advanced by
// P x V. kDim: the padded head size when it is one the compiler should specialize for (64, 128),
// else 0 and `padded` says it at run time.
template <int64_t kDim, int64_t kQ>
void attend_tiles(const Tile* tiles, int64_t n, const float* qs, int64_t padded, float /*scale: in qs*/,
                  const int64_t (*visible)[kBatch][2], float* run_max, float* run_sum, float* acc, Prefetch& ahead) {
  const int64_t dim = kDim > 0 ? kDim : padded;
  float s[kQ][kKeys];
  for (int64_t i = 0; i < n; ++i) {
    float si[kQ][kTile] = {};
    for (int64_t d = 0; d < dim; ++d) {
      ahead.next();
      const float* kd = tiles[i].keys + d * tiles[i].key_stride;
      for (int64_t j = 0; j < kQ; ++j) {
        const float qd = qs[j * dim + d];
#pragma omp simd
        for (int64_t t = 0; t < kTile; ++t) si[j][t] += qd * kd[t];
      }
    }
    place_scores<kQ>(si, i, visible, s);
  }
  float p[kQ][kKeys];
  float correction[kQ];
  softmax_step<kQ>(s, n, run_max, run_sum, p, correction);
  for (int64_t d0 = 0; d0 < dim; d0 += kTile) {  // dim is a multiple of kTile
    float a[kQ][kTile];
    for (int64_t j = 0; j < kQ; ++j) {
#pragma omp simd
      for (int64_t e = 0; e < kTile; ++e) a[j][e] = acc[j * dim + d0 + e] * correction[j];
    }
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t t = 0; t < tiles[i].count; ++t) {
        ahead.next();
        const float* vt = tiles[i].values + t * tiles[i].value_stride + d0;
        for (int64_t j = 0; j < kQ; ++j) {
          const float pj = p[j][i * kTile + t];
#pragma omp simd
          for (int64_t e = 0; e < kTile; ++e) a[j][e] += pj * vt[e];
        }
      }
    }
    for (int64_t j = 0; j < kQ; ++j) {
#pragma omp simd
      for (int64_t e = 0; e < kTile; ++e) acc[j * dim + d0 + e] = a[j][e];
    }
  }
}

#if defined(__AVX512BF16__)
// The same step on packed bfloat16 tiles (attention_bf16.h): qs [kQ, kDim / 2] bfloat16 pairs, unscaled
// (the scores are scaled in float32).
template <int64_t kDim, int64_t kQ>
void attend_tiles_bf16(const tokenmill_bf16::Tile* tiles, int64_t n, const uint32_t* qs, int64_t /*padded*/,
                       float scale, const int64_t (*visible)[kBatch][2], float* run_max, float* run_sum, float* acc,
                       Prefetch& ahead) {
  float s[kQ][kKeys];
  for (int64_t i = 0; i < n; ++i) {
    float si[kQ][kTile];
    tokenmill_bf16::scores<kDim, kQ>(tiles[i], qs, scale, si, [&ahead] { ahead.next(); });
    place_scores<kQ>(si, i, visible, s);
  }
  float p[kQ][kKeys];
  float correction[kQ];
  softmax_step<kQ>(s, n, run_max, run_sum, p, correction);
  tokenmill_bf16::add_values<kDim, kQ, kKeys>(tiles, n, p, correction, acc);
}
#endif

// What every work item of a call reads of the cache: the K and V chunks (C: the model's dtype, or
// int8 with per-token scales [num_blocks, kv_heads, block_size]) and the block tables.
template <typename C>
struct Pages {
  const C* k;
  const C* v;
  const float* k_scales;  // (int8 only)
  const float* v_scales;
  const int32_t* tables;
  int64_t table_row, kv_heads, block_size, dim, width;  // width: head_dim padded to whole vectors
  int64_t chunk_at(int64_t seq, int64_t h, int64_t blk) const {  // (block, KV head) chunk's first element
    return (static_cast<int64_t>(tables[seq * table_row + blk]) * kv_heads + h) * block_size * dim;
  }
};

#if defined(__AVX512BF16__)
constexpr bool kBf16Dots = true;
using Bf16Tile = tokenmill_bf16::Tile;
#else
constexpr bool kBf16Dots = false;
using Bf16Tile = Tile;  // (never used: no bfloat16 dot products to run it)
#endif

// The form a call's tiles take: float32 (`Tile`, widened from any cache), or packed bfloat16 pairs
// (`Bf16Tile`, a bfloat16 cache on AVX-512 BF16 with a head size of 64 or 128). Buf: the element of
// its buffers; Q: the element of its queries.
template <bool kBf16>
struct Form {
  using TileT = std::conditional_t<kBf16, Bf16Tile, Tile>;
  using Buf = std::conditional_t<kBf16, uint32_t, float>;
  using Q = std::conditional_t<kBf16, uint32_t, float>;
  using Fn = void (*)(const TileT*, int64_t, const Q*, int64_t, float, const int64_t (*)[kBatch][2], float*, float*,
                      float*, Prefetch&);
};

// Up to kBatch consecutive tiles of keys; t0: each tile's first key position.
template <typename TileT>
struct Batch {
  TileT tiles[kBatch];
  int64_t t0[kBatch];
  int64_t n = 0;
};

// The next batch of seq's KV head h from the key at (blk, first), up to position end (the cursor
// advanced past it), into kbuf / vbuf (widened, or packed); `ahead` set to the batch after it.
template <bool kBf16, typename C>
void load_batch(const Pages<C>& pg, int64_t seq, int64_t h, int64_t end, int64_t& blk, int64_t& first,
                typename Form<kBf16>::Buf* kbuf, typename Form<kBf16>::Buf* vbuf,
                Batch<typename Form<kBf16>::TileT>& batch, Prefetch& ahead) {
  const int64_t bs = pg.block_size, width = pg.width;
  for (batch.n = 0; batch.n < kBatch && blk * bs < end; ++batch.n) {
    const int64_t at = pg.chunk_at(seq, h, blk), in_block = std::min(bs, end - blk * bs);
    const int64_t count = std::min(kTile, in_block - first);
    auto* kb = kbuf + batch.n * width * kTile;
    auto* vb = vbuf + batch.n * kTile * width;
    batch.t0[batch.n] = blk * bs + first;
#if defined(__AVX512BF16__)
    if constexpr (kBf16) {
      batch.tiles[batch.n] = tokenmill_bf16::pack(pg.k + at, pg.v + at, bs, first, count, pg.dim, kb, vb);
    } else
#endif
    if constexpr (std::is_same_v<C, int8_t>) {
      const int64_t at_scales = at / pg.dim;  // the chunk's [block_size] scales
      batch.tiles[batch.n] = load_tile_int8(pg.k + at, pg.v + at, pg.k_scales + at_scales, pg.v_scales + at_scales, bs,
                                            first, count, pg.dim, width, kb, vb);
    } else if constexpr (!kBf16) {
      batch.tiles[batch.n] = load_tile(pg.k + at, pg.v + at, bs, first, count, pg.dim, width, kb, vb);
    }
    first += count;
    if (first >= in_block) first = 0, ++blk;
  }
  ahead = Prefetch();  // the next batch's blocks sit on other pages: fetched a line at a time meanwhile
  for (int64_t next = blk; next < blk + kBatch && next * bs < end; ++next) {
    ahead.add(pg.k + pg.chunk_at(seq, h, next), bs * pg.dim);
    ahead.add(pg.v + pg.chunk_at(seq, h, next), bs * pg.dim);
  }
}

// A work item's queries: `nq` rows (positions x the heads sharing the KV head, `group` a position)
// padded to whole groups of kQueries (q: `stride` elements a row), each with its running max, lane
// sums and accumulators [padded, width].
template <typename Q>
struct Queries {
  std::vector<Q> q;
  std::vector<float> acc, run_max, run_sum;
  int64_t nq = 0, padded = 0, stride = 0, group = 1, first_pos = 0;
  float scale = 1.f;  // applied to the scores (1 where q is scaled already)
  std::optional<int64_t> window;
};

// Every query group of `qs` against one batch: kWideQueries at a time while there are as many, then
// kQueries; a group none of whose queries sees a key of the batch is skipped.
template <bool kBf16>
void attend_batch(const Batch<typename Form<kBf16>::TileT>& batch, Queries<typename Form<kBf16>::Q>& qs, int64_t width,
                  typename Form<kBf16>::Fn narrow, typename Form<kBf16>::Fn wide, Prefetch& ahead) {
  for (int64_t j0 = 0; j0 < qs.padded;) {
    const int64_t step = qs.nq - j0 >= kWideQueries ? kWideQueries : kQueries;
    int64_t visible[kWideQueries][kBatch][2];
    bool any = false;
    for (int64_t j = 0; j < step; ++j) {
      const int64_t pos = qs.first_pos + (j0 + j) / qs.group;
      for (int64_t i = 0; i < batch.n; ++i) {
        const int64_t t0 = batch.t0[i];
        const int64_t from = qs.window ? std::max<int64_t>(0, pos - *qs.window + 1 - t0) : 0;
        const int64_t to = j0 + j < qs.nq ? std::min(batch.tiles[i].count, pos - t0 + 1) : 0;  // padding: none
        visible[j][i][0] = from;
        visible[j][i][1] = std::max(from, to);
        any = any || from < to;
      }
    }
    if (any)  // else every key of the batch is after (or, windowed, too far before) these queries
      (step == kWideQueries ? wide : narrow)(batch.tiles, batch.n, qs.q.data() + j0 * qs.stride, width, qs.scale,
                                             visible, qs.run_max.data() + j0, qs.run_sum.data() + j0 * kTile,
                                             qs.acc.data() + j0 * width, ahead);
    j0 += step;
  }
}

// The tile step for a form, queries a step and head size: the specialized ones for 64 and 128.
template <bool kBf16, int64_t kQ>
typename Form<kBf16>::Fn tiles_fn(int64_t width) {
#if defined(__AVX512BF16__)
  if constexpr (kBf16) {
    return width == 64 ? &attend_tiles_bf16<64, kQ> : &attend_tiles_bf16<128, kQ>;
  } else
#endif
  if constexpr (!kBf16) {
    return width == 64 ? &attend_tiles<64, kQ> : width == 128 ? &attend_tiles<128, kQ> : &attend_tiles<0, kQ>;
  } else {
    return nullptr;
  }
}

// Slice `it`'s queries into qs: bfloat16 pairs as they are, or float32 scaled by sc.
template <typename T, typename Q>
void load_queries(const T* qp, int64_t q_row, int64_t q_head, int64_t first_row, int64_t h, int64_t dim, float sc,
                  Queries<Q>& qs) {
  for (int64_t j = 0; j < qs.nq; ++j) {
    const T* src = qp + (first_row + j / qs.group) * q_row + (h * qs.group + j % qs.group) * q_head;
    Q* dst = qs.q.data() + j * qs.stride;
    if constexpr (std::is_same_v<Q, uint32_t>) {
      std::memcpy(dst, src, dim * sizeof(T));
    } else {
      to_float(src, dst, dim);
      for (int64_t d = 0; d < dim; ++d) dst[d] *= sc;
    }
  }
}

// Work items: (sequence, KV head, a slice of its query positions). A decode's slice is its one
// token; a prompt chunk's queries are cut into slices of about kSliceRows query rows, so that a
// long chunk keeps every thread busy, and a slice's queries and accumulators stay in L1 while the
// cache's keys and values stream past them (each tile widened once for all the slice's rows).
// Later slices see more keys: items go, last slice first, to whichever thread is free.
std::vector<Slice> slices(const int32_t* qlens, int64_t num_seqs, int64_t group, int64_t kv_heads) {
  std::vector<Slice> items;
  const int64_t per = std::max<int64_t>(1, kSliceRows / group);  // positions a slice
  for (int64_t b = 0; b < num_seqs; ++b)
    for (int64_t hi = qlens[b]; hi > 0; hi -= per)
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({b, h, std::max<int64_t>(0, hi - per), hi});
  return items;
}

// T: q and out; C: the cache (T itself, or int8 with per-token scales); kBf16: the tiles' form.
template <typename T, typename C, bool kBf16>
void attend(at::Tensor& out, const at::Tensor& q, const Pages<C>& pg, const at::Tensor& seq_lens,
            const at::Tensor& query_starts, const at::Tensor& query_lens, double scale, std::optional<int64_t> window) {
  using F = Form<kBf16>;
  const int64_t dim = pg.dim, width = pg.width, group = q.size(1) / pg.kv_heads;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* qlens = query_lens.data_ptr<int32_t>();
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float sc = static_cast<float>(scale) * 1.44269504088896341f;  // scores in base 2: log2(e) / sqrt(d)
  const std::vector<Slice> items = slices(qlens, seq_lens.size(0), group, pg.kv_heads);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items)));
#pragma omp parallel num_threads(threads)
  {
    const auto narrow = tiles_fn<kBf16, kQueries>(width), wide = tiles_fn<kBf16, kWideQueries>(width);
    std::vector<typename F::Buf> kbuf(kBatch * width * kTile), vbuf(kBatch * kTile * width);
    Queries<typename F::Q> qs;
    qs.group = group;
    qs.window = window;
    qs.stride = kBf16 ? width / 2 : width;
    qs.scale = kBf16 ? sc : 1.f;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; ++item) {
      const Slice& it = items[item];
      const int64_t b = it.seq, h = it.kv_head, first_row = starts[b] + it.first;
      qs.nq = (it.last - it.first) * group;  // the slice's queries: its positions x group heads
      qs.padded = (qs.nq + kQueries - 1) / kQueries * kQueries;
      qs.q.assign(qs.padded * qs.stride, 0);
      qs.acc.assign(qs.padded * width, 0.f);
      qs.run_max.assign(qs.padded, kNegInf);
      qs.run_sum.assign(qs.padded * kTile, 0.f);
      load_queries(qp, q.stride(0), q.stride(1), first_row, h, dim, sc, qs);
      qs.first_pos = lens[b] - qlens[b] + it.first;  // position of the slice's first query
      const int64_t end = lens[b] - qlens[b] + it.last;  // keys at positions < end are visible to some query
      int64_t blk = (window ? std::max<int64_t>(0, qs.first_pos - *window + 1) : 0) / pg.block_size, first = 0;
      Batch<typename F::TileT> batch;
      Prefetch ahead;
      while (blk * pg.block_size < end) {
        load_batch<kBf16>(pg, b, h, end, blk, first, kbuf.data(), vbuf.data(), batch, ahead);
        attend_batch<kBf16>(batch, qs, width, narrow, wide, ahead);
      }
      for (int64_t j = 0; j < qs.nq; ++j) {
        T* dst = op + (first_row + j / group) * out.stride(0) + (h * group + j % group) * out.stride(1);
        float sum = 0.f;
        for (int64_t t = 0; t < kTile; ++t) sum += qs.run_sum[j * kTile + t];
        for (int64_t d = 0; d < dim; ++d) dst[d] = from_float<T>(qs.acc[j * width + d] / sum);
      }
    }
  }
}

}  // namespace

// The ops' entry points, also called from decode_layer.cpp (declared in ops.h).
namespace tokenmill {

void check_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t block_size, int64_t dim,
                    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, kv_heads, block_size * head_dim]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must match");
  TORCH_CHECK(block_size > 0 && k_cache.size(2) == block_size * dim, "cache chunks must hold block_size * head_dim");
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == k_scale.has_value() && int8 == v_scale.has_value(), "an int8 cache, and only one, has scales");
  if (int8)
    for (const at::Tensor* s : {&*k_scale, &*v_scale})
      TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 3 &&
                      s->size(0) == k_cache.size(0) && s->size(1) == k_cache.size(1) && s->size(2) == block_size,
                  "cache scales must be contiguous float32 [num_blocks, kv_heads, block_size]");
}

// out[T, heads, D] = attention of q[T, heads, D] (rows of a flat batch; the last dim contiguous)
// over each sequence's cached K/V, for the B sequences whose queries are rows
// [query_starts[b], query_starts[b] + query_lens[b]) of q; block_tables [B, max_blocks], seq_lens,
// query_starts and query_lens [B] are int32. Other rows of out are left untouched.
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_starts,
                     const at::Tensor& query_lens, int64_t block_size, double scale, std::optional<int64_t> window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1, "q and out must be [T, heads, D], D contiguous");
  check_kv_cache(k_cache, v_cache, block_size, q.size(2), k_scale, v_scale);
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK((int8 || q.scalar_type() == k_cache.scalar_type()) && out.scalar_type() == q.scalar_type(),
              "q, out and the caches must share a dtype (or the caches be int8)");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of the cache's KV heads");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_starts, &query_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->stride(-1) == 1, "attention metadata must be int32, contiguous");
  }
  TORCH_CHECK(block_tables.size(0) == seq_lens.size(0) && query_starts.size(0) == seq_lens.size(0) &&
                  query_lens.size(0) == seq_lens.size(0),
              "block_tables, seq_lens, query_starts and query_lens need one entry per sequence");
  const float* ks = int8 ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = int8 ? v_scale->data_ptr<float>() : nullptr;
  const int64_t dim = q.size(2), width = (dim + kTile - 1) / kTile * kTile;
  const auto run = [&]<typename T>() {
    const auto pages = [&]<typename C>() {
      return Pages<C>{k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), ks, vs, block_tables.data_ptr<int32_t>(),
                      block_tables.stride(0), k_cache.size(1), block_size, dim, width};
    };
    if (int8) {
      attend<T, int8_t, false>(out, q, pages.template operator()<int8_t>(), seq_lens, query_starts, query_lens, scale,
                               window);
      return;
    }
    if constexpr (kBf16Dots && std::is_same_v<T, c10::BFloat16>) {  // bfloat16 dot products: head size 64 or 128
      if (dim == 64 || dim == 128) {
        attend<T, T, true>(out, q, pages.template operator()<T>(), seq_lens, query_starts, query_lens, scale, window);
        return;
      }
    }
    attend<T, T, false>(out, q, pages.template operator()<T>(), seq_lens, query_starts, query_lens, scale, window);
  };
  if (q.scalar_type() == at::kFloat) {
    run.template operator()<float>();
  } else if (q.scalar_type() == at::kBFloat16) {
    run.template operator()<c10::BFloat16>();
  } else {
    TORCH_CHECK(false, "paged_attention: float32 and bfloat16 only");
  }
}

}  // namespace tokenmill

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_scale, Tensor? v_scale, "
      "Tensor block_tables, "
      "Tensor seq_lens, Tensor query_starts, Tensor query_lens, int block_size, float scale, int? window) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &tokenmill::paged_attention);
}

// The 16-row layout of GGUF's Q4_K, Q5_K, Q6_K, Q4_0, Q4_1 and Q8_0 blocks (gguf_x16.cpp's products read it):
// sizes, and one block of 16 rows packed from the file's blocks and unpacked back to them.
//
// A group's block (256 weights of 16 rows; the rows' bytes are the file's, moved):
//   Q4_K, 2368 bytes (148 a row: the file's 144, with the 6-bit scales and mins a byte each):
//     [0, 2048)     32 lines of 64 bytes: line 4R + i, byte 4r + j: row r's weight 32R + 4i + j (low
//                   nibble) and 32R + 16 + 4i + j (high nibble)
//     [2048, 2112)  d [16], then dmin [16], fp16
//     [2112, 2240)  the scales, [run R][row r]
//     [2240, 2368)  the mins in pairs, [k][row r][2]: runs 2k, 2k + 1
//   Q5_K, 2880 bytes (180 a row for the file's 176): Q4_K's 2368, then the weights' fifth bits in 8
//                   lines: line R, byte 4r + j, bit i / 4 + i: the low / high nibble's of line 4R + i
//   Q6_K, 3360 bytes (210 a row, the file's size):
//     [0, 2048)     32 lines: line 2G + h, byte 4r + j: the low 4 bits of row r's weights 16G + 8h + j
//                   (low nibble) and 16G + 8h + 4 + j (high nibble)
//     [2048, 3072)  16 lines: line G, byte 4r + j: the high 2 bits of weights 16G + 4t + j at bits 2t
//     [3072, 3328)  the scales, [group G][row r], int8
//     [3328, 3360)  d [16], fp16
//   Q4_0 (32 weights), 288 bytes: 4 lines, line i byte 4r + j: weights 4i + j (low nibble), 16 + 4i + j
//                   (high; the file's bytes as they are), then d [16]; Q4_1, 320: the same, then m [16];
//                   Q8_0, 544: 8 lines, line i byte 4r + j: weight 4i + j + 128 (unsigned for
//                   vpdpbusd), then d [16]
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gguf_formats.h"
#include "gguf_x16.h"

namespace tm_x16 {

using namespace tm_gguf;

constexpr int64_t group_bytes(int type) {
  return type == 12 ? 2368 : type == 13 ? 2880 : type == 14 ? 3360 : type == 2 ? 288 : type == 3 ? 320 : 544;
}
constexpr int64_t file_bytes(int type) {
  return type == 12 ? 144 : type == 13 ? 176 : type == 14 ? 210 : type == 2 ? 18 : type == 3 ? 20 : 34;
}
constexpr int64_t nibbles_at(int type) { return type == 3 ? 4 : 2; }  // a 32-weight block's q bytes in the file
constexpr int64_t block_weights(int type) { return type >= 12 ? 256 : 32; }

// ---- repacking (and its inverse, for dequantized rows) ----
// 16 file blocks (rows r: src + r * stride) -> one group block
template <int TYPE>
void pack_block(const uint8_t* src, int64_t stride, uint8_t* g) {
  std::memset(g, 0, group_bytes(TYPE));
  alignas(32) uint8_t q[256];
  for (int r = 0; r < ROWS; ++r) {
    const uint8_t* p = src + r * stride;
    if constexpr (TYPE == 2 || TYPE == 3 || TYPE == 8) {  // (Q4_x's byte l: weights l, l + 16, as lines want)
      const uint8_t* qb = p + nibbles_at(TYPE);
      for (int i = 0; i < (TYPE == 8 ? 8 : 4); ++i)
        for (int j = 0; j < 4; ++j) g[64 * i + 4 * r + j] = TYPE == 8 ? qb[4 * i + j] ^ 0x80 : qb[4 * i + j];
      std::memcpy(g + (TYPE == 8 ? 512 : 256) + 2 * r, p, 2);
      if constexpr (TYPE == 3) std::memcpy(g + 288 + 2 * r, p + 2, 2);
    } else if constexpr (TYPE == 12 || TYPE == 13) {
      for (int R = 0; R < 8; ++R) run_scalar<std::conditional_t<TYPE == 12, Q4_K, Q5_K>>(p, R, q + 32 * R);
      for (int R = 0; R < 8; ++R)
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) {
            const int lo = q[32 * R + 4 * i + j], hi = q[32 * R + 16 + 4 * i + j];
            g[(4 * R + i) * 64 + 4 * r + j] = (lo & 15) | ((hi & 15) << 4);
            if constexpr (TYPE == 13) g[2368 + 64 * R + 4 * r + j] |= ((lo >> 4) << i) | ((hi >> 4) << (4 + i));
          }
      std::memcpy(g + 2048 + 2 * r, p, 2), std::memcpy(g + 2080 + 2 * r, p + 2, 2);
      uint64_t sc, mn;
      k4_scales(p + 4, sc, mn);
      for (int R = 0; R < 8; ++R) g[2112 + 16 * R + r] = (sc >> (8 * R)) & 255;
      for (int R = 0; R < 8; ++R) g[2240 + 32 * (R / 2) + 2 * r + R % 2] = (mn >> (8 * R)) & 255;
    } else {
      for (int R = 0; R < 8; ++R) run_scalar<Q6_K>(p, R, q + 32 * R);
      for (int k = 0; k < 256; ++k) {
        const int G = k / 16, t = (k % 16) / 4, j = k % 4;
        g[(2 * G + t / 2) * 64 + 4 * r + j] |= (q[k] & 15) << (4 * (t % 2));
        g[2048 + G * 64 + 4 * r + j] |= (q[k] >> 4) << (2 * t);
      }
      for (int G = 0; G < 16; ++G) g[3072 + 16 * G + r] = p[192 + G];
      std::memcpy(g + 3328 + 2 * r, p + 208, 2);
    }
  }
}

// row r of a group block -> the file's block (the bytes the file held)
template <int TYPE>
void unpack_block(const uint8_t* g, int r, uint8_t* p) {
  std::memset(p, 0, file_bytes(TYPE));
  if constexpr (TYPE == 2 || TYPE == 3 || TYPE == 8) {
    uint8_t* qb = p + nibbles_at(TYPE);
    for (int i = 0; i < (TYPE == 8 ? 8 : 4); ++i)
      for (int j = 0; j < 4; ++j) qb[4 * i + j] = TYPE == 8 ? g[64 * i + 4 * r + j] ^ 0x80 : g[64 * i + 4 * r + j];
    std::memcpy(p, g + (TYPE == 8 ? 512 : 256) + 2 * r, 2);
    if constexpr (TYPE == 3) std::memcpy(p + 2, g + 288 + 2 * r, 2);
  } else if constexpr (TYPE == 12 || TYPE == 13) {
    std::memcpy(p, g + 2048 + 2 * r, 2), std::memcpy(p + 2, g + 2080 + 2 * r, 2);
    uint8_t sc[8], mn[8];
    for (int R = 0; R < 8; ++R) sc[R] = g[2112 + 16 * R + r], mn[R] = g[2240 + 32 * (R / 2) + 2 * r + R % 2];
    for (int j = 0; j < 4; ++j) {  // k4_scales' packing, inverted
      p[4 + j] = sc[j] | ((sc[4 + j] >> 4) << 6);
      p[8 + j] = mn[j] | ((mn[4 + j] >> 4) << 6);
      p[12 + j] = (sc[4 + j] & 15) | ((mn[4 + j] & 15) << 4);
    }
    for (int R = 0; R < 8; ++R)
      for (int l = 0; l < 32; ++l) {
        const int i = (l % 16) / 4, j = l % 4;
        const uint8_t b = g[(4 * R + i) * 64 + 4 * r + j];
        p[(TYPE == 12 ? 16 : 48) + 32 * (R / 2) + l] |= ((l < 16 ? b & 15 : b >> 4) << (4 * (R % 2)));
        if constexpr (TYPE == 13)  // (the file's high bits: byte l, bit R)
          p[16 + l] |= ((g[2368 + 64 * R + 4 * r + j] >> (l < 16 ? i : 4 + i)) & 1) << R;
      }
  } else {
    for (int k = 0; k < 256; ++k) {
      const int G = k / 16, t = (k % 16) / 4, j = k % 4;
      const int q = ((g[(2 * G + t / 2) * 64 + 4 * r + j] >> (4 * (t % 2))) & 15) | (((g[2048 + G * 64 + 4 * r + j] >> (2 * t)) & 3) << 4);
      const int R = k / 32, l = k % 32, h = R / 4, tt = R % 4;  // the file's layout (run_scalar<Q6_K>)
      p[64 * h + 32 * (tt % 2) + l] |= (q & 15) << (4 * (tt / 2));
      p[128 + 32 * h + l] |= (q >> 4) << (2 * tt);
    }
    for (int G = 0; G < 16; ++G) p[192 + G] = g[3072 + 16 * G + r];
    std::memcpy(p + 208, g + 3328 + 2 * r, 2);
  }
}

}  // namespace tm_x16

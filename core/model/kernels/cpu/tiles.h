// AMX's tiles as our kernels use them (bf16_tiles.cc, flash.h): a block of 32 x 32
// float32 sums in tiles 0-3 from two tiles of A's rows (4, 5) and two of B's columns (6, 7),
// B laid out in panels of 32 columns whose rows hold pairs of B's rows side by side, as
// TDPBF16PS reads them.
#pragma once

#include "operands.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define APPS_TILES 1
#endif

constexpr int64_t kSide = 32;    // rows and columns of a block; K goes through in steps of 32 too

static inline int64_t whole(int64_t n) { return (n + kSide - 1) / kSide * kSide; }

#ifdef APPS_TILES

// The offsets of 16 gathered lanes `apart` units from one another: 0, apart, ..., 15 apart.
static inline __m512i lanes_apart(int64_t apart) {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32(int32_t(apart)));
}

// 32 values of a row from `from` (up to `count` of them, zeros after) as bfloat16 bits.
static inline __m512i row32(const float* from, int64_t count) {
  const __m512 low = _mm512_maskz_loadu_ps(first16(count), from);
  const __m512 high = _mm512_maskz_loadu_ps(first16(count - 16), from + 16);
  return __m512i(_mm512_cvtne2ps_pbh(high, low));
}
static inline __m512i row32(const uint16_t* from, int64_t count) {
  return _mm512_maskz_loadu_epi16(count >= 32 ? ~0u : __mmask32((1u << count) - 1), from);
}

// Rows 2j and 2j + 1 of 32 columns (bfloat16 bits) as row j of their panel: column c's pair
// side by side, columns 0-15 in the row's first 64 bytes, 16-31 in its second.
static inline void paired(__m512i even, __m512i odd, uint16_t* row) {
  alignas(64) static constexpr uint16_t kFirst[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kSecond[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  _mm512_storeu_si512(row, _mm512_permutex2var_epi16(even, _mm512_load_si512(kFirst), odd));
  _mm512_storeu_si512(row + 32, _mm512_permutex2var_epi16(even, _mm512_load_si512(kSecond), odd));
}

struct TileShapes {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: sums 16 x 16 float32, A 16 x 32 and B 16 pairs x 16 x 2 bfloat16.
static void configure() {
  TileShapes shapes;
  for (int t = 0; t < 8; ++t) shapes.rows[t] = 16, shapes.bytes[t] = 64;
  _tile_loadconfig(&shapes);
}

// C's block of 32 x 32 at `c` (row stride `stride` floats) from 32 rows of A (`width` apart)
// and one panel of B, over depths [begin, end): the sums start from C's (`add`) or from zero.
static inline void block(const uint16_t* a, int64_t width, const uint16_t* panel, int64_t begin, int64_t end, float* c,
                         int64_t stride, bool add) {
  if (add) {
    _tile_loadd(0, c, stride * 4);
    _tile_loadd(1, c + 16, stride * 4);
    _tile_loadd(2, c + 16 * stride, stride * 4);
    _tile_loadd(3, c + 16 * stride + 16, stride * 4);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = begin; k < end; k += kSide) {
    _tile_loadd(4, a + k, width * 2);
    _tile_loadd(5, a + 16 * width + k, width * 2);
    _tile_loadd(6, panel + k * kSide, 128);
    _tile_loadd(7, panel + k * kSide + 32, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, stride * 4);
  _tile_stored(1, c + 16, stride * 4);
  _tile_stored(2, c + 16 * stride, stride * 4);
  _tile_stored(3, c + 16 * stride + 16, stride * 4);
}

#endif  // APPS_TILES

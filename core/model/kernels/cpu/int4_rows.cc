// Int4 weights times float32 rows on the CPU, for the few rows of a decoding step
// (core/model/native.py builds this folder and registers it with XLA; core/model/int4.py calls it):
//   y[r, o] = sum_g scales[o, g] * sum_j x[r, 32g + j] * q[o, 32g + j] + offsets[o, g] * sum_j x[r, 32g + j]
// where q in [0, 15] are the weights of output o, two to a byte (byte k of group g holds weight
// 32g + k in its low four bits and 32g + 16 + k in its high four), scales and offsets float16.
//
// Why a kernel of our own: a decoding step reads every weight once, so its time is the bytes it
// reads, and XLA has no product that reads four-bit weights without writing them out wider
// first. Here each output's weights lie in one contiguous row, read in order through the matrix
// (the hardware prefetcher's best case). One to three rows (`block`) multiply in integers: each
// row's group of 32 inputs in two int8 parts (`Activations`: within 1/32,258 of its largest
// magnitude, where llama.cpp's one part, Q8_1, is within 1/254), a pair of groups' 64 products
// summed by a few instructions (VNNI's dpbusd where the CPU has it, else AVX2's maddubs and
// madd), the weights never wider than a byte. Blocks of four rows (`widened_block`) widen each
// group's weights to float32 once for the four and sum in float32, cheaper a row than the two
// parts. The products of SmolLM2's 30 layers at one row: 6.5 against 7.6-8.0 ms for float32
// throughout with float32 scales (6.4-6.8 against 7.7-8.0 with AVX2 alone); at eight rows 16.5-17.8
// against 16.9. Work is split by outputs between the calling thread and a helper thread of our
// own (`Helper`).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "helper.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

constexpr int64_t kGroup = 32, kPair = 2 * kGroup;

// The inputs go through in pairs of groups, whose 32 bytes unpack in one vector to their low
// four bits (inputs 0-15 of the first group, then 0-15 of the second: 0-15 and 32-47 of the pair)
// and in another to their high four (16-31 and 48-63). The activations are stored in that order
// (`place`), a lone last group in its own.
static inline int64_t place(int64_t i, int64_t inputs) {
  const int64_t start = i / kPair * kPair, k = i - start;
  if (start + kPair > inputs) return i;
  static constexpr int64_t kChunk[4] = {0, 2, 1, 3};
  return start + kChunk[k / 16] * 16 + k % 16;
}

static inline __m256i bytes32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// 127 * (w1 . a1 + w2 . a2) + (w1 . b1 + w2 . b2) in eight int32 lanes, each from four bytes of
// each vector: unsigned weights w in [0, 15], activations' high parts a and low parts b. At most
// 8 * 15 * (127 * 127 + 64) in a lane: exact in int32 and in float32 (under 2^24).
static inline __m256i sums(__m256i w1, __m256i w2, __m256i a1, __m256i a2, __m256i b1, __m256i b2) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  const __m256i zero = _mm256_setzero_si256();
  const __m256i high = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(zero, w1, a1), w2, a2);
  const __m256i low = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(zero, w1, b1), w2, b2);
  return _mm256_add_epi32(_mm256_sub_epi32(_mm256_slli_epi32(high, 7), high), low);
#else  // pairs of products in int16 (at most 4 * 15 * 127 in two pairs: never saturated), then in int32
  const __m256i high = _mm256_add_epi16(_mm256_maddubs_epi16(w1, a1), _mm256_maddubs_epi16(w2, a2));
  const __m256i low = _mm256_add_epi16(_mm256_maddubs_epi16(w1, b1), _mm256_maddubs_epi16(w2, b2));
  return _mm256_add_epi32(_mm256_madd_epi16(high, _mm256_set1_epi16(127)), _mm256_madd_epi16(low, _mm256_set1_epi16(1)));
#endif
}

// The rows of x as the kernel reads them: each group of 32 inputs scaled to [-127, 127] by its
// largest magnitude, in two int8 parts (`high` rounded, then its rounding error times 127 rounded
// again: one part alone moved SmolLM2's logits by up to 4), in `place` order, with the step of
// 127 * high + low (`steps`) and the group's float32 sum (the offsets' factor).
struct Activations {
  const float* x;
  std::vector<int8_t> high, low;
  std::vector<float> steps, sums;

  // Rows from `first` on in parts (the rows before it go through `widened_block`, which reads x).
  Activations(const float* x, int64_t rows, int64_t inputs, int64_t first)
      : x(x), high(rows * inputs), low(rows * inputs), steps(rows * inputs / kGroup), sums(rows * inputs / kGroup) {
    const int64_t groups = inputs / kGroup;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const float* xs = x + r * inputs + g * kGroup;
        __m256 v[4], sum = _mm256_setzero_ps(), largest = _mm256_setzero_ps();
        for (int k = 0; k < 4; ++k) {
          v[k] = _mm256_loadu_ps(xs + 8 * k);
          sum = _mm256_add_ps(sum, v[k]);
          largest = _mm256_max_ps(largest, _mm256_and_ps(v[k], magnitude));
        }
        sums[r * groups + g] = sum8(sum);
        if (r < first) continue;
        const float most = max8(largest), inverse = most > 0.0f ? 127.0f / most : 0.0f;
        steps[r * groups + g] = most / (127.0f * 127.0f);
        for (int k = 0; k < 4; ++k) {  // eight inputs in a row stay side by side in `place` order
          const __m256 scaled = _mm256_mul_ps(v[k], _mm256_set1_ps(inverse));
          const __m256 rounded = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          const int64_t at = r * inputs + place(g * kGroup + 8 * k, inputs);
          store8(high.data() + at, _mm256_cvtps_epi32(rounded));
          store8(low.data() + at, _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(scaled, rounded), _mm256_set1_ps(127.0f))));
        }
      }
  }

 private:
  // Eight int32 lanes in [-127, 127] as eight bytes.
  static void store8(int8_t* p, __m256i v) {
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v, v), v);  // lanes 0-3 in bytes 0-3, 4-7 in 16-19
    const int32_t first = _mm256_extract_epi32(bytes, 0), second = _mm256_extract_epi32(bytes, 4);
    std::memcpy(p, &first, 4);
    std::memcpy(p + 4, &second, 4);
  }
};

static inline __m256 halves(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// sum_g offsets[g] * sums[g], the offsets' term of one row and output (offsets float16).
static inline float offset_term(const uint16_t* offsets, const float* sums, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(halves(offsets + g), _mm256_loadu_ps(sums + g), acc);
  float sum = sum8(acc);
  for (; g < groups; ++g) sum += _cvtsh_ss(offsets[g]) * sums[g];
  return sum;
}

// For one row and output: each group's two scales multiplied, four times over (the lanes of a
// pair's sums), eight groups at a time.
static inline void scale_lanes(const uint16_t* scales, const float* steps, int64_t groups, float* both) {
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 scale = _mm256_mul_ps(halves(scales + g), _mm256_loadu_ps(steps + g));
    for (int k = 0; k < 4; ++k) {
      const __m256i lanes = _mm256_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1);
      _mm256_storeu_ps(both + (g + 2 * k) * 4, _mm256_permutevar8x32_ps(scale, lanes));
    }
  }
  for (; g < groups; ++g) std::fill_n(both + g * 4, 4, _cvtsh_ss(scales[g]) * steps[g]);
}

// Outputs [o, o + OUTS) for ROWS rows from row r of the activations: the outputs' sums run side
// by side, each pair's weights unpacked once for all the rows; `both` has room for the scales of
// ROWS * OUTS rows and outputs.
template <int ROWS, int OUTS>
static void block(const Activations& a, int64_t r, const uint8_t* values, const uint16_t* scales,
                  const uint16_t* offsets, float* y, int64_t inputs, int64_t outputs, int64_t o, float* both) {
  const int64_t groups = inputs / kGroup;
  const int8_t *hs = a.high.data() + r * inputs, *ls = a.low.data() + r * inputs;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[ROWS][OUTS];
  for (int i = 0; i < ROWS; ++i)
    for (int u = 0; u < OUTS; ++u) {
      scale_lanes(scales + (o + u) * groups, a.steps.data() + (r + i) * groups, groups, both + (i * OUTS + u) * groups * 4);
      acc[i][u] = _mm256_setzero_ps();
    }
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    for (int u = 0; u < OUTS; ++u) {
      const __m256i bytes = bytes32(values + (o + u) * inputs / 2 + g * kGroup / 2);
      const __m256i w1 = _mm256_and_si256(bytes, nibble), w2 = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      for (int i = 0; i < ROWS; ++i) {  // the activations reloaded from the first level cache, not kept in registers
        const int8_t *h = hs + i * inputs + g * kGroup, *l = ls + i * inputs + g * kGroup;
        const __m256i products = sums(w1, w2, bytes32(h), bytes32(h + kGroup), bytes32(l), bytes32(l + kGroup));
        const __m256 scale = _mm256_loadu_ps(both + ((i * OUTS + u) * groups + g) * 4);
        acc[i][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(products), scale, acc[i][u]);
      }
    }
  }
  if (g < groups)  // a lone last group: its 16 bytes unpacked into one vector, its activations in order
    for (int u = 0; u < OUTS; ++u) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values + (o + u) * inputs / 2 + g * kGroup / 2));
      const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), nibble);
      const __m256i none = _mm256_setzero_si256();
      for (int i = 0; i < ROWS; ++i) {
        const __m256i h = bytes32(hs + i * inputs + g * kGroup), l = bytes32(ls + i * inputs + g * kGroup);
        const __m256 scale = _mm256_broadcast_ss(both + ((i * OUTS + u) * groups + g) * 4);
        acc[i][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums(w, none, h, h, l, l)), scale, acc[i][u]);
      }
    }
  for (int i = 0; i < ROWS; ++i)
    for (int u = 0; u < OUTS; ++u)
      y[(r + i) * outputs + o + u] = sum8(acc[i][u]) + offset_term(offsets + (o + u) * groups, a.sums.data() + (r + i) * groups, groups);
}

// The 32 weights of a group from its 16 bytes, as float32 vectors in order.
static inline void widened(const uint8_t* p, Vec* w) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), low = _mm_set1_epi8(0x0F);
  const __m128i first = _mm_and_si128(bytes, low), second = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
#if defined(__AVX512F__)
  w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first));
  w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second));
#else
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(first, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(second, 8)));
#endif
}

// Outputs [o, o + OUTS) for ROWS rows as `block`, for four rows or more: each group's weights
// widened to float32 once for all the rows, each row's products in float32 (the integer parts
// cost more a row than the widening saves: 8 rows of SmolLM2's products 17 against 20 ms).
template <int ROWS, int OUTS>
static void widened_block(const Activations& a, int64_t r, const uint8_t* values, const uint16_t* scales,
                          const uint16_t* offsets, float* y, int64_t inputs, int64_t outputs, int64_t o, float*) {
  constexpr int64_t kVectors = kGroup / kLanes;
  const int64_t groups = inputs / kGroup;
  Vec acc[ROWS][OUTS];
  for (int i = 0; i < ROWS; ++i)
    for (int u = 0; u < OUTS; ++u) acc[i][u] = zero();
  for (int64_t g = 0; g < groups; ++g)
    for (int u = 0; u < OUTS; ++u) {
      Vec w[kVectors];
      widened(values + (o + u) * inputs / 2 + g * kGroup / 2, w);
      const Vec s = broadcast(_cvtsh_ss(scales[(o + u) * groups + g]));
      for (int i = 0; i < ROWS; ++i) {
        const float* xs = a.x + (r + i) * inputs + g * kGroup;
        Vec part = mul(load(xs), w[0]);
        for (int k = 1; k < kVectors; ++k) part = fma(load(xs + k * kLanes), w[k], part);
        acc[i][u] = fma(s, part, acc[i][u]);
      }
    }
  for (int i = 0; i < ROWS; ++i)
    for (int u = 0; u < OUTS; ++u)
      y[(r + i) * outputs + o + u] = total(acc[i][u]) + offset_term(offsets + (o + u) * groups, a.sums.data() + (r + i) * groups, groups);
}

template <int ROWS, int OUTS>
static void rows_block(const Activations& a, int64_t r, const uint8_t* values, const uint16_t* scales,
                       const uint16_t* offsets, float* y, int64_t inputs, int64_t outputs, int64_t begin, int64_t end,
                       float* both) {
  constexpr auto kBlock = ROWS >= 4 ? widened_block<ROWS, OUTS> : block<ROWS, OUTS>;
  constexpr auto kOne = ROWS >= 4 ? widened_block<ROWS, 1> : block<ROWS, 1>;
  int64_t o = begin;
  for (; o + OUTS <= end; o += OUTS) kBlock(a, r, values, scales, offsets, y, inputs, outputs, o, both);
  for (; o < end; ++o) kOne(a, r, values, scales, offsets, y, inputs, outputs, o, both);
}

// Outputs [begin, end) for all rows: four rows at a time by two outputs (each pair's weights
// unpacked once for the four), then two or one by four outputs (more sums side by side).
static void outputs_range(const Activations& a, const uint8_t* values, const uint16_t* scales, const uint16_t* offsets,
                          float* y, int64_t rows, int64_t inputs, int64_t outputs, int64_t begin, int64_t end) {
  // The scales of a block's rows and outputs (8 of them at most), a buffer per thread kept across
  // calls: no allocation on a decoding step's path.
  thread_local std::vector<float> both;
  both.resize(8 * inputs / kGroup * 4);
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) rows_block<4, 2>(a, r, values, scales, offsets, y, inputs, outputs, begin, end, both.data());
  for (; r + 2 <= rows; r += 2) rows_block<2, 4>(a, r, values, scales, offsets, y, inputs, outputs, begin, end, both.data());
  if (r < rows) rows_block<1, 4>(a, r, values, scales, offsets, y, inputs, outputs, begin, end, both.data());
}

using Rows = ffi::Buffer<ffi::F32, 2>;
using Values = ffi::Buffer<ffi::U8, 2>;
using Scales = ffi::Buffer<ffi::F16, 2>;

static ffi::Error Int4RowsImpl(Rows x, Values values, Scales scales, Scales offsets,
                               ffi::ResultBuffer<ffi::F32, 2> y) {
  const int64_t rows = x.dimensions()[0], inputs = x.dimensions()[1];
  const int64_t outputs = values.dimensions()[0], groups = inputs / kGroup;
  if (inputs % kGroup || values.dimensions()[1] * 2 != inputs || scales.dimensions()[0] != outputs ||
      scales.dimensions()[1] != groups || offsets.dimensions()[0] != outputs || offsets.dimensions()[1] != groups)
    return ffi::Error::InvalidArgument("int4_rows: x [R, I], values [O, I/2], scales and offsets [O, I/32] disagree");
  const Activations a(x.typed_data(), rows, inputs, rows / 4 * 4);
  // Sixteen pieces, so that the two threads finish together.
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(outputs / 4, 16));
  const int64_t step = (outputs + pieces - 1) / pieces;
  const uint8_t* vs = values.typed_data();
  const uint16_t *sc = scales.typed_data(), *of = offsets.typed_data();
  float* ys = y->typed_data();
  const std::function<void(int64_t)> piece = [&](int64_t k) {
    const int64_t begin = k * step, end = std::min(outputs, (k + 1) * step);
    if (begin < end) outputs_range(a, vs, sc, of, ys, rows, inputs, outputs, begin, end);
  };
  Helper::get().run(pieces, piece);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(Int4Rows, Int4RowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<Rows>()
                                  .Arg<Values>()
                                  .Arg<Scales>()
                                  .Arg<Scales>()
                                  .Ret<Rows>());

// Int4 weights times float32 rows on the CPU, for the few rows of a decoding step
// (core/model/native.py builds this folder and registers it with XLA; core/model/int4.py calls it):
//   y[r, o] = sum_g scales[o, g] * sum_j x[r, 32g + j] * q[o, 32g + j] + offsets[o, g] * sum_j x[r, 32g + j]
// where q in [0, 15] are the weights of output o, two to a byte: byte k of group g holds weight
// 32g + k in its low four bits and 32g + 16 + k in its high four.
//
// Why a kernel of our own: a decoding step reads every weight once, so its time is the bytes it
// reads, and XLA has no product that reads four-bit weights without writing them out wider
// first. Here each output's weights lie in one contiguous row, read in order through the matrix
// (the hardware prefetcher's best case), widened to float32 in registers and multiplied with the
// float32 activations in float32 sums. Work is split by outputs between the calling thread and
// a helper thread of our own (`Helper`).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <tuple>
#include <vector>

#include "helper.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// The 32 weights of a group from its 16 bytes, as float32 vectors in order.
static inline void group(const uint8_t* p, Vec* w) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), low = _mm_set1_epi8(0x0F);
#if defined(__AVX512F__)
  w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low)));
  w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low)));
#else
  const __m128i first = _mm_and_si128(bytes, low), second = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(first));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(first, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(second));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(second, 8)));
#endif
}

constexpr int64_t kGroup = 32, kVectors = kGroup / kLanes;

// Outputs [o, o + OUTS) for ROWS rows of x from x[0] (their group sums from sums[0]): the
// outputs' sums run side by side, each group's weights widened once for all the rows.
template <int ROWS, int OUTS>
static void block(const float* x, const float* sums, const uint8_t* values, const float* scales,
                  const float* offsets, float* y, int64_t inputs, int64_t outputs, int64_t o) {
  const int64_t groups = inputs / kGroup;
  Vec acc[ROWS][OUTS];
  for (int r = 0; r < ROWS; ++r)
    for (int u = 0; u < OUTS; ++u) acc[r][u] = zero();
  for (int64_t g = 0; g < groups; ++g) {
    for (int u = 0; u < OUTS; ++u) {
      Vec w[kVectors];
      group(values + (o + u) * inputs / 2 + g * kGroup / 2, w);
      const Vec s = broadcast(scales[(o + u) * groups + g]);
      for (int r = 0; r < ROWS; ++r) {
        const float* xs = x + r * inputs + g * kGroup;
        Vec part = mul(load(xs), w[0]);
        for (int k = 1; k < kVectors; ++k) part = fma(load(xs + k * kLanes), w[k], part);
        acc[r][u] = fma(s, part, acc[r][u]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int u = 0; u < OUTS; ++u)
      y[r * outputs + o + u] = total(acc[r][u]) + dot(offsets + (o + u) * groups, sums + r * groups, groups);
}

template <int ROWS, int OUTS>
static void rows_block(const float* x, const float* sums, const uint8_t* values, const float* scales,
                       const float* offsets, float* y, int64_t inputs, int64_t outputs, int64_t begin, int64_t end) {
  int64_t o = begin;
  for (; o + OUTS <= end; o += OUTS) block<ROWS, OUTS>(x, sums, values, scales, offsets, y, inputs, outputs, o);
  for (; o < end; ++o) block<ROWS, 1>(x, sums, values, scales, offsets, y, inputs, outputs, o);
}

// Outputs [begin, end) for all rows: four rows at a time by two outputs (each group's weights
// widened once for the four), then two or one by four outputs (more sums side by side).
static void outputs_range(const float* x, const float* sums, const uint8_t* values, const float* scales,
                          const float* offsets, float* y, int64_t rows, int64_t inputs, int64_t outputs,
                          int64_t begin, int64_t end) {
  const int64_t groups = inputs / kGroup;
  auto at = [&](int64_t r) { return std::make_tuple(x + r * inputs, sums + r * groups, y + r * outputs); };
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    auto [xr, sr, yr] = at(r);
    rows_block<4, 2>(xr, sr, values, scales, offsets, yr, inputs, outputs, begin, end);
  }
  for (; r + 2 <= rows; r += 2) {
    auto [xr, sr, yr] = at(r);
    rows_block<2, 4>(xr, sr, values, scales, offsets, yr, inputs, outputs, begin, end);
  }
  if (r < rows) {
    auto [xr, sr, yr] = at(r);
    rows_block<1, 4>(xr, sr, values, scales, offsets, yr, inputs, outputs, begin, end);
  }
}


using Rows = ffi::Buffer<ffi::F32, 2>;
using Values = ffi::Buffer<ffi::U8, 2>;
using Scales = ffi::Buffer<ffi::F32, 2>;

static ffi::Error Int4RowsImpl(Rows x, Values values, Scales scales, Scales offsets,
                               ffi::ResultBuffer<ffi::F32, 2> y) {
  const int64_t rows = x.dimensions()[0], inputs = x.dimensions()[1];
  const int64_t outputs = values.dimensions()[0], groups = inputs / kGroup;
  if (inputs % kGroup || values.dimensions()[1] * 2 != inputs || scales.dimensions()[0] != outputs ||
      scales.dimensions()[1] != groups || offsets.dimensions()[0] != outputs || offsets.dimensions()[1] != groups)
    return ffi::Error::InvalidArgument("int4_rows: x [R, I], values [O, I/2], scales and offsets [O, I/32] disagree");
  const float* xs = x.typed_data();
  std::vector<float> sums(rows * groups, 0.0f);  // each row's sum over each group: the offsets' factor
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < inputs; ++i) sums[r * groups + i / kGroup] += xs[r * inputs + i];
  // Sixteen pieces, so that the two threads finish together.
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(outputs / 4, 16));
  const int64_t step = (outputs + pieces - 1) / pieces;
  const float* ss = sums.data();
  const uint8_t* vs = values.typed_data();
  const float *sc = scales.typed_data(), *of = offsets.typed_data();
  float* ys = y->typed_data();
  const std::function<void(int64_t)> piece = [=](int64_t k) {
    const int64_t begin = k * step, end = std::min(outputs, (k + 1) * step);
    if (begin < end) outputs_range(xs, ss, vs, sc, of, ys, rows, inputs, outputs, begin, end);
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

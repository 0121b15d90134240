// Self- and cross-attention of a training step, forward and backward, on AMX's tiles
// (core/model/flash.py calls it; core/model/native.py builds this folder); this header holds what
// flash_forward.cc and flash_backward.cc share:
//   flash_forward:  q [B, Tq, N, H], k, v [B, Tk, K, H] (bfloat16), the keys' mask [B, Tk] and
//                   the positions' segments [B, Tq], [B, Tk] -> out [B, Tq, N, H] float32 and
//                   each query's log-sum-exp of its scores, lse [B, N, Tq];
//   flash_backward: the same and lse, with the output's gradient [B, Tq, N, H] (bfloat16)
//                   -> the gradients of q, k and v, float32.
// Query head n reads key head n / G (G = N / K). Query t sees key j where the mask holds, in
// its own segment, and with `causal` where j <= t (and t - j < window, if one is set); a query
// that sees no key gives zeros.
//
// Why a kernel of our own: XLA's form of it (core/model/attention.py's blockwise kernel) runs
// each product, the softmax and its gradient as separate operations over the [T, T] scores of
// every head, about a third of SmolLM2's fine-tuning step, for a tenth of its products. Here a
// block of 32 queries keeps its scores in cache from product to softmax to product: the scores
// of the keys it sees, 32 at a time, on the tiles (tiles.h); the softmax on AVX-512; the
// probabilities, rounded to bfloat16 as XLA rounds them, times the values on the tiles again.
// The backward recomputes the scores from lse instead of saving the probabilities (whose
// float32 copies took a gigabyte of the step's peak) and forms the keys' and values'
// gradients transposed, [H, Tk], so that a block's probabilities and score gradients enter
// the tiles as panels (pairs of query rows), built as they are computed.
#pragma once

#include <cmath>
#include <limits>
#include <vector>

#include "tiles.h"
#include "vectors.h"

using Half = ffi::Buffer<ffi::BF16>;
using Single = ffi::Buffer<ffi::F32>;
using Mask = ffi::Buffer<ffi::U8>;
using Segments = ffi::Buffer<ffi::S32>;

static const uint16_t* bits_of(const Half& x) { return reinterpret_cast<const uint16_t*>(x.typed_data()); }

#ifdef APPS_TILES

constexpr float kUnseen = -std::numeric_limits<float>::infinity();

struct Attention {
  int64_t batch, queries, keys, heads, key_heads, width;  // B, Tq, Tk, N, K, H
  bool causal;
  int64_t window;
  const uint8_t* mask;
  const int32_t *query_segments, *key_segments;

  int64_t group() const { return heads / key_heads; }
  int64_t padded() const { return whole(keys); }
  float scale() const { return 1.0f / std::sqrt(float(width)); }

  // Keys [first, last) that query t may see, in whole blocks of 32.
  void span(int64_t t, int64_t rows, int64_t& first, int64_t& last) const {
    first = 0, last = padded();
    if (!causal) return;
    last = whole(std::min(keys, t + rows));
    if (window > 0) first = std::max<int64_t>(0, t - window + 1) / kSide * kSide;
  }

  // Which of keys j .. j + 15 row b's query t sees.
  __mmask16 sees(int64_t b, int64_t t, int64_t j) const {
    __mmask16 seen = first16(keys - j);
    seen = _mm_mask_cmpneq_epi8_mask(seen, _mm_maskz_loadu_epi8(seen, mask + b * keys + j), _mm_setzero_si128());
    seen = _mm512_mask_cmpeq_epi32_mask(seen, _mm512_maskz_loadu_epi32(seen, key_segments + b * keys + j),
                                        _mm512_set1_epi32(query_segments[b * queries + t]));
    if (causal) {
      seen &= first16(t - j + 1);
      if (window > 0) seen &= __mmask16(~first16(t - window + 1 - j));
    }
    return seen;
  }

  // Row b's query t of head n in x [B, Tq, N, H], and its key j of key head g in x [B, Tk, K, H].
  template <class T>
  T* query_row(T* x, int64_t b, int64_t t, int64_t n) const {
    return x + ((b * queries + t) * heads + n) * width;
  }
  template <class T>
  T* key_row(T* x, int64_t b, int64_t j, int64_t g) const {
    return x + ((b * keys + j) * key_heads + g) * width;
  }
};

// Keys (or values) of row b's key head g as B panels of their transpose, [Tk/32][H/2][64]:
// panel c's row r holds the pair of dimensions 2r, 2r + 1 of keys 32c .. 32c + 31 (one 32-bit word each).
static void transposed_panels(const Attention& a, const uint16_t* x, int64_t b, int64_t g, uint32_t* out) {
  const int64_t words = a.width / 2;
  for (int64_t j = 0; j < a.padded(); ++j) {
    const auto* row = reinterpret_cast<const uint32_t*>(a.key_row(x, b, std::min(j, a.keys - 1), g));
    uint32_t* panel = out + j / kSide * words * kSide + j % kSide;
    for (int64_t r = 0; r < words; ++r) panel[r * kSide] = j < a.keys ? row[r] : 0;
  }
}

// The same as B panels of their dimensions, [H/32][Tk/2][64]: panel p's row j holds dimensions
// 32p .. 32p + 31 of keys 2j and 2j + 1 side by side.
static void column_panels(const Attention& a, const uint16_t* x, int64_t b, int64_t g, uint16_t* out) {
  const int64_t pairs = a.padded() / 2;
  for (int64_t p = 0; p < a.width / kSide; ++p)
    for (int64_t j = 0; j < pairs; ++j) {
      const auto row = [&](int64_t key) {
        return key < a.keys ? row32(a.key_row(x, b, key, g) + p * kSide, kSide)
                            : _mm512_setzero_si512();
      };
      paired(row(2 * j), row(2 * j + 1), out + (p * pairs + j) * 64);
    }
}

// 32 rows of head n of x [B, T, N, H] from query t on, zeros past T, as bfloat16 rows [32, H].
static void rows_of(const Attention& a, const uint16_t* x, int64_t b, int64_t n, int64_t t, uint16_t* out) {
  for (int64_t i = 0; i < kSide; ++i)
    for (int64_t d = 0; d < a.width; d += kSide)
      _mm512_storeu_si512(out + i * a.width + d, t + i < a.queries ? row32(a.query_row(x, b, t + i, n) + d, kSide)
                                                                   : _mm512_setzero_si512());
}

// scores [32, padded] = rows [32, H] times the keys' transposed panels, over keys [first, last).
static void scores_of(const Attention& a, const uint16_t* rows, const uint16_t* keys, int64_t first, int64_t last,
                      float* scores) {
  for (int64_t c = first; c < last; c += kSide)
    block(rows, a.width, keys + c * a.width, 0, a.width, scores + c, a.padded(), false);
}

// out [32, H] = weights [32, padded] (bfloat16) times the column panels, over keys [first, last).
static void weighted(const Attention& a, const uint16_t* weights, const uint16_t* columns, int64_t first, int64_t last,
                     float* out) {
  for (int64_t p = 0; p < a.width / kSide; ++p)
    block(weights, a.padded(), columns + p * a.padded() * kSide, first, last, out + p * kSide, a.width, false);
}

static void store_bf16(uint16_t* to, Vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), __m256i(_mm512_cvtneps_pbh(v)));
}

// A buffer of at least `size` elements, kept from call to call in a thread's own buffers (XLA's
// threads live as long as the process): fresh ones cost page faults and zeroing in every call.
template <class T>
static T* sized(std::vector<T>& buffer, int64_t size) {
  if (int64_t(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

// The call's shapes, checked: q [B, Tq, N, H], k and v [B, Tk, K, H], the mask [B, Tk] and
// segments [B, Tq] and [B, Tk], H a multiple of 32, N of K, and Tq = Tk when causal.
static ffi::Error described(const Half& q, const Half& k, const Half& v, const Mask& mask, const Segments& query_segments,
                            const Segments& key_segments, bool causal, int64_t window, Attention& a) {
  const auto qs = q.dimensions(), ks = k.dimensions();
  if (qs.size() != 4 || ks.size() != 4 || v.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("flash attention: q, k and v are [B, T, heads, H]");
  a = {qs[0], qs[1], ks[1], qs[2], ks[2], qs[3], causal, window};
  const bool fits = ks[0] == a.batch && ks[3] == a.width && k.element_count() == v.element_count() &&
                    a.width % kSide == 0 && a.heads % a.key_heads == 0 && (!causal || a.queries == a.keys) &&
                    mask.element_count() == a.batch * a.keys && query_segments.element_count() == a.batch * a.queries &&
                    key_segments.element_count() == a.batch * a.keys;
  if (!fits) return ffi::Error::InvalidArgument("flash attention: the operands' shapes disagree");
  a.mask = mask.typed_data();
  a.query_segments = query_segments.typed_data();
  a.key_segments = key_segments.typed_data();
  return ffi::Error::Success();
}

#endif  // APPS_TILES

// body(attention, q, k, v, b, g) for each key head g of each row b, on XLA's threads with the
// tiles configured, once the operands' shapes are checked (q, k, v as bfloat16 bits).
template <class F>
static ffi::Error each_key_head(ffi::ThreadPool& pool, const Half& q, const Half& k, const Half& v, const Mask& mask,
                                const Segments& query_segments, const Segments& key_segments, bool causal,
                                int64_t window, F&& body) {
#ifdef APPS_TILES
  Attention a;
  if (auto error = described(q, k, v, mask, query_segments, key_segments, causal, window, a); error.failure()) return error;
  run(pool, a.batch * a.key_heads, [&](int64_t unit) {
    configure();
    body(a, bits_of(q), bits_of(k), bits_of(v), unit / a.key_heads, unit % a.key_heads);
    _tile_release();
  });
  return ffi::Error::Success();
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "flash attention: this library was built for a CPU without AMX");
#endif
}

// The FFI binding of the operands both passes take first: q, k, v, the mask and the segments.
static auto operands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<Half>()
      .Arg<Half>()
      .Arg<Half>()
      .Arg<Mask>()
      .Arg<Segments>()
      .Arg<Segments>();
}

// Self- and cross-attention of a training step, forward and backward, on AMX's tiles
// (core/model/flash.py calls it; core/model/native.py builds this folder):
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
#include <cmath>
#include <limits>
#include <vector>

#include "tiles.h"
#include "vectors.h"

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

  // Element (t, head, d) of q [B, T, heads, H] in row b.
  template <class T>
  static T* at(T* x, int64_t b, int64_t t, int64_t length, int64_t head, int64_t count, int64_t width) {
    return x + ((b * length + t) * count + head) * width;
  }
};

// Keys (or values) of row b's key head g as B panels of their transpose, [Tk/32][H/2][64]:
// panel c's row r holds the pair of dimensions 2r, 2r + 1 of keys 32c .. 32c + 31 (one 32-bit word each).
static void transposed_panels(const Attention& a, const uint16_t* x, int64_t b, int64_t g, uint32_t* out) {
  const int64_t words = a.width / 2;
  for (int64_t j = 0; j < a.padded(); ++j) {
    const auto* row = reinterpret_cast<const uint32_t*>(Attention::at(x, b, std::min(j, a.keys - 1), a.keys, g, a.key_heads, a.width));
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
        return key < a.keys ? row32(Attention::at(x, b, key, a.keys, g, a.key_heads, a.width) + p * kSide, kSide)
                            : _mm512_setzero_si512();
      };
      paired(row(2 * j), row(2 * j + 1), out + (p * pairs + j) * 64);
    }
}

// 32 rows of head n of x [B, T, N, H] from query t on, zeros past T, as bfloat16 rows [32, H].
static void rows_of(const Attention& a, const uint16_t* x, int64_t b, int64_t n, int64_t t, uint16_t* out) {
  for (int64_t i = 0; i < kSide; ++i)
    for (int64_t d = 0; d < a.width; d += kSide)
      _mm512_storeu_si512(out + i * a.width + d, t + i < a.queries ? row32(Attention::at(x, b, t + i, a.queries, n, a.heads, a.width) + d, kSide)
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

static void store_bf16(uint16_t* to, Vec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), __m256i(_mm512_cvtneps_pbh(v))); }

// Row b's query t over keys [first, last) of its scores (unscaled): the probabilities into
// `weights` as bfloat16 -> their log-sum-exp (-inf where the query sees no key).
static float softmax(const Attention& a, int64_t b, int64_t t, float* scores, uint16_t* weights, int64_t first, int64_t last) {
  const Vec scale = broadcast(a.scale());
  Vec top = broadcast(kUnseen);
  for (int64_t j = first; j < last; j += kLanes) {
    const Vec s = _mm512_mask_mul_ps(broadcast(kUnseen), a.sees(b, t, j), load(scores + j), scale);
    store(scores + j, s);
    top = max(top, s);
  }
  const float peak = largest(top);
  if (peak == kUnseen) {
    for (int64_t j = first; j < last; j += kLanes) store_bf16(weights + j, zero());
    return kUnseen;
  }
  Vec sums = zero();
  for (int64_t j = first; j < last; j += kLanes) {
    const Vec e = exp_negative(sub(load(scores + j), broadcast(peak)));
    store(scores + j, e);
    sums = add(sums, e);
  }
  const float sum = total(sums);
  for (int64_t j = first; j < last; j += kLanes) store_bf16(weights + j, mul(load(scores + j), broadcast(1.0f / sum)));
  return peak + std::log(sum);
}

// A thread's buffers, kept from call to call (XLA's threads live as long as the process):
// fresh ones of these sizes cost page faults and zeroing in every call.
struct Buffers {
  std::vector<uint16_t> key_panels, value_panels, key_columns, queries, grads, q_rows, g_rows, weights, score_gradients,
      weight_panels, gradient_panels;
  std::vector<float> scores, gradients, block_out, keys_t, values_t;  // keys_t, values_t: dK, dV transposed, [H, padded]
};
static thread_local Buffers held;

template <class T>
static T* sized(std::vector<T>& buffer, int64_t size) {
  if (int64_t(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

static void forward(const Attention& a, const uint16_t* q, const uint16_t* k, const uint16_t* v, float* out, float* lse,
                    int64_t b, int64_t g) {
  const int64_t keys = a.padded();
  uint16_t *key_panels = sized(held.key_panels, keys * a.width), *value_panels = sized(held.value_panels, keys * a.width);
  uint16_t *rows = sized(held.q_rows, kSide * a.width), *weights = sized(held.weights, kSide * keys);
  float *scores = sized(held.scores, kSide * keys), *block_out = sized(held.block_out, kSide * a.width);
  transposed_panels(a, k, b, g, reinterpret_cast<uint32_t*>(key_panels));
  column_panels(a, v, b, g, value_panels);
  for (int64_t n = g * a.group(); n < (g + 1) * a.group(); ++n)
    for (int64_t t = 0; t < a.queries; t += kSide) {
      int64_t first, last;
      a.span(t, kSide, first, last);
      rows_of(a, q, b, n, t, rows);
      scores_of(a, rows, key_panels, first, last, scores);
      for (int64_t i = 0; i < kSide; ++i)
        if (t + i < a.queries)
          lse[(b * a.heads + n) * a.queries + t + i] = softmax(a, b, t + i, scores + i * keys, weights + i * keys, first, last);
        else
          std::fill(weights + i * keys + first, weights + i * keys + last, 0);
      weighted(a, weights, value_panels, first, last, block_out);
      for (int64_t i = 0; i < kSide && t + i < a.queries; ++i)
        std::memcpy(Attention::at(out, b, t + i, a.queries, n, a.heads, a.width), block_out + i * a.width, a.width * 4);
    }
}

// The queries whose terms of dK and dV go through the tiles together: 128 deep, so that each
// block of sums is loaded and stored once for four TDPBF16PS of its tiles, not one.
constexpr int64_t kSpan = 4 * kSide;

// Head n's rows of x [B, T, N, H] transposed, [H, length] bfloat16 (length a multiple of 16, at
// least T), zeros past T: 16 rows at a time, a gather of a pair of dimensions each.
static void transposed_rows(const Attention& a, const uint16_t* x, int64_t b, int64_t n, int64_t length, uint16_t* out) {
  const __m512i apart = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(int32_t(a.heads * a.width * 2)));
  for (int64_t t = 0; t < length; t += 16) {
    const __mmask16 real = first16(a.queries - t);
    const uint16_t* row = real ? Attention::at(x, b, t, a.queries, n, a.heads, a.width) : x;
    for (int64_t r = 0; r < a.width / 2; ++r) {
      const __m512i pair = real ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, apart, row + 2 * r, 1)
                                : _mm512_setzero_si512();
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * r * length + t), _mm512_cvtepi32_epi16(pair));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (2 * r + 1) * length + t),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(pair, 16)));
    }
  }
}

// Row b's query t over keys [first, last): from its scores (unscaled; their probabilities
// recomputed there from lse) and the gradients of its probabilities, the probabilities and the
// scores' gradients (scaled) as bfloat16 rows.
static void softmax_gradient(const Attention& a, int64_t b, int64_t t, float lse, float* scores, const float* gradients,
                             uint16_t* weights, uint16_t* score_gradients, int64_t first, int64_t last) {
  Vec sums = zero();  // sum_j p_j dp_j, the softmax gradient's shared term
  const Vec scale = broadcast(a.scale()), shift = broadcast(lse);
  for (int64_t j = first; j < last; j += kLanes) {
    const __mmask16 seen = lse == kUnseen ? 0 : a.sees(b, t, j);
    const Vec p = _mm512_maskz_mov_ps(seen, exp_negative(sub(mul(load(scores + j), scale), shift)));
    store(scores + j, p);
    store_bf16(weights + j, p);
    sums = fma(p, load(gradients + j), sums);
  }
  const Vec shared = broadcast(total(sums));
  for (int64_t j = first; j < last; j += kLanes)
    store_bf16(score_gradients + j, mul(mul(load(scores + j), sub(load(gradients + j), shared)), scale));
}

// `count` rows of bfloat16 [count, padded] as B panels of 32 keys, [padded/32][count/2][64], keys [first, last).
static void row_panels(const Attention& a, const uint16_t* rows, int64_t count, int64_t first, int64_t last, uint16_t* out) {
  const int64_t keys = a.padded();
  for (int64_t c = first; c < last; c += kSide)
    for (int64_t j = 0; j < count / 2; ++j)
      paired(_mm512_loadu_si512(rows + 2 * j * keys + c), _mm512_loadu_si512(rows + (2 * j + 1) * keys + c),
             out + c * count + j * 64);
}

// The 32 queries of head n from t over keys [from, to): their rows of dq, and their
// probabilities and scores' gradients into rows [0, 32) of `weights` and `gradients`, zeros in
// [first, last) outside [from, to).
static void backward_rows(const Attention& a, const uint16_t* q, const uint16_t* grad, const float* lse, float* dq,
                          int64_t b, int64_t n, int64_t t, int64_t first, int64_t last, uint16_t* weights,
                          uint16_t* gradients) {
  const int64_t keys = a.padded();
  int64_t from, to;
  a.span(t, kSide, from, to);
  for (int64_t i = 0; i < kSide; ++i) {
    std::fill(weights + i * keys + first, weights + i * keys + last, 0);
    std::fill(gradients + i * keys + first, gradients + i * keys + last, 0);
  }
  if (t >= a.queries) return;
  rows_of(a, q, b, n, t, held.q_rows.data());
  rows_of(a, grad, b, n, t, held.g_rows.data());
  scores_of(a, held.q_rows.data(), held.key_panels.data(), from, to, held.scores.data());
  scores_of(a, held.g_rows.data(), held.value_panels.data(), from, to, held.gradients.data());  // dP = dO V^T
  for (int64_t i = 0; i < kSide; ++i) {
    const float l = t + i < a.queries ? lse[(b * a.heads + n) * a.queries + t + i] : kUnseen;
    softmax_gradient(a, b, t + i, l, held.scores.data() + i * keys, held.gradients.data() + i * keys, weights + i * keys,
                     gradients + i * keys, from, to);
  }
  weighted(a, gradients, held.key_columns.data(), from, to, held.block_out.data());  // dQ = dS K
  for (int64_t i = 0; i < kSide && t + i < a.queries; ++i)
    std::memcpy(Attention::at(dq, b, t + i, a.queries, n, a.heads, a.width), held.block_out.data() + i * a.width, a.width * 4);
}

// The queries of head n from t to t + kSpan: their rows of dq, and their terms of dK and dV,
// dV^T += dO^T P and dK^T += Q^T dS ([H, kSpan] times [kSpan, keys]).
static void backward_span(const Attention& a, const uint16_t* q, const uint16_t* grad, const float* lse, float* dq,
                          int64_t b, int64_t n, int64_t t, int64_t length) {
  const int64_t keys = a.padded();
  int64_t first, last, unused;
  a.span(t, kSide, first, unused);
  a.span(t + kSpan - kSide, kSide, unused, last);
  uint16_t *weights = held.weights.data(), *gradients = held.score_gradients.data();
  for (int64_t u = 0; u < kSpan; u += kSide)
    backward_rows(a, q, grad, lse, dq, b, n, t + u, first, last, weights + u * keys, gradients + u * keys);
  row_panels(a, weights, kSpan, first, last, held.weight_panels.data());
  row_panels(a, gradients, kSpan, first, last, held.gradient_panels.data());
  for (int64_t r = 0; r < a.width; r += kSide)
    for (int64_t c = first; c < last; c += kSide) {
      block(held.grads.data() + r * length + t, length, held.weight_panels.data() + c * kSpan, 0, kSpan,
            held.values_t.data() + r * keys + c, keys, true);
      block(held.queries.data() + r * length + t, length, held.gradient_panels.data() + c * kSpan, 0, kSpan,
            held.keys_t.data() + r * keys + c, keys, true);
    }
}

// x^T [H, padded] float32 into key head g's rows of x [B, Tk, K, H]: 16 dimensions a gather.
static void transposed_back(const Attention& a, const float* x_t, float* x, int64_t b, int64_t g) {
  const __m512i apart = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(int32_t(a.padded() * 4)));
  for (int64_t j = 0; j < a.keys; ++j)
    for (int64_t d = 0; d < a.width; d += 16)
      store(Attention::at(x, b, j, a.keys, g, a.key_heads, a.width) + d, _mm512_i32gather_ps(apart, x_t + d * a.padded() + j, 1));
}

static void backward(const Attention& a, const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* grad,
                     const float* lse, float* dq, float* dk, float* dv, int64_t b, int64_t g) {
  const int64_t keys = a.padded(), length = (a.queries + kSpan - 1) / kSpan * kSpan;
  for (auto* buffer : {&held.key_panels, &held.value_panels, &held.key_columns}) sized(*buffer, keys * a.width);
  for (auto* buffer : {&held.queries, &held.grads}) sized(*buffer, a.width * length);
  for (auto* buffer : {&held.q_rows, &held.g_rows}) sized(*buffer, kSide * a.width);
  for (auto* buffer : {&held.weights, &held.score_gradients, &held.weight_panels, &held.gradient_panels}) sized(*buffer, kSpan * keys);
  for (auto* buffer : {&held.scores, &held.gradients}) sized(*buffer, kSide * keys);
  sized(held.block_out, kSide * a.width);
  std::fill_n(sized(held.keys_t, a.width * keys), a.width * keys, 0.0f);
  std::fill_n(sized(held.values_t, a.width * keys), a.width * keys, 0.0f);
  transposed_panels(a, k, b, g, reinterpret_cast<uint32_t*>(held.key_panels.data()));
  transposed_panels(a, v, b, g, reinterpret_cast<uint32_t*>(held.value_panels.data()));
  column_panels(a, k, b, g, held.key_columns.data());
  for (int64_t n = g * a.group(); n < (g + 1) * a.group(); ++n) {
    transposed_rows(a, q, b, n, length, held.queries.data());
    transposed_rows(a, grad, b, n, length, held.grads.data());
    for (int64_t t = 0; t < a.queries; t += kSpan) backward_span(a, q, grad, lse, dq, b, n, t, length);
  }
  transposed_back(a, held.keys_t.data(), dk, b, g);
  transposed_back(a, held.values_t.data(), dv, b, g);
}

#endif  // APPS_TILES

using Half = ffi::Buffer<ffi::BF16>;
using Single = ffi::Buffer<ffi::F32>;
using Mask = ffi::Buffer<ffi::U8>;
using Segments = ffi::Buffer<ffi::S32>;

static const uint16_t* bits_of(const Half& x) { return reinterpret_cast<const uint16_t*>(x.typed_data()); }

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

static ffi::Error Unsupported() {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "flash_tiles: this library was built for a CPU without AMX");
}

static ffi::Error FlashForwardImpl(ffi::ThreadPool pool, Half q, Half k, Half v, Mask mask, Segments query_segments,
                                   Segments key_segments, ffi::Result<Single> out, ffi::Result<Single> lse, bool causal,
                                   int64_t window) {
#ifdef APPS_TILES
  Attention a;
  if (auto error = described(q, k, v, mask, query_segments, key_segments, causal, window, a); error.failure()) return error;
  run(pool, a.batch * a.key_heads, [&](int64_t unit) {
    configure();
    forward(a, bits_of(q), bits_of(k), bits_of(v), out->typed_data(), lse->typed_data(), unit / a.key_heads, unit % a.key_heads);
    _tile_release();
  });
  return ffi::Error::Success();
#else
  return Unsupported();
#endif
}

static ffi::Error FlashBackwardImpl(ffi::ThreadPool pool, Half q, Half k, Half v, Mask mask, Segments query_segments,
                                    Segments key_segments, Single lse, Half grad, ffi::Result<Single> dq,
                                    ffi::Result<Single> dk, ffi::Result<Single> dv, bool causal, int64_t window) {
#ifdef APPS_TILES
  Attention a;
  if (auto error = described(q, k, v, mask, query_segments, key_segments, causal, window, a); error.failure()) return error;
  run(pool, a.batch * a.key_heads, [&](int64_t unit) {
    configure();
    backward(a, bits_of(q), bits_of(k), bits_of(v), bits_of(grad), lse.typed_data(), dq->typed_data(), dk->typed_data(),
             dv->typed_data(), unit / a.key_heads, unit % a.key_heads);
    _tile_release();
  });
  return ffi::Error::Success();
#else
  return Unsupported();
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashForward, FlashForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Half>()
                                  .Arg<Half>()
                                  .Arg<Half>()
                                  .Arg<Mask>()
                                  .Arg<Segments>()
                                  .Arg<Segments>()
                                  .Ret<Single>()
                                  .Ret<Single>()
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("window"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashBackward, FlashBackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Half>()
                                  .Arg<Half>()
                                  .Arg<Half>()
                                  .Arg<Mask>()
                                  .Arg<Segments>()
                                  .Arg<Segments>()
                                  .Arg<Single>()
                                  .Arg<Half>()
                                  .Ret<Single>()
                                  .Ret<Single>()
                                  .Ret<Single>()
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("window"));

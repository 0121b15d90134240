// The backward pass of flash.h's attention: for each key head of a row, its query heads' blocks
// of 32 queries recompute their scores and probabilities from lse, form dq, and add their terms
// of dK and dV, both kept transposed ([H, Tk]) while 128 queries at a time go through the tiles.
#include "flash.h"

#ifdef APPS_TILES

// A thread's buffers for `backward` (`sized`).
struct Buffers {
  std::vector<uint16_t> key_panels, value_panels, key_columns, queries, grads, q_rows, g_rows, weights, score_gradients,
      weight_panels, gradient_panels;
  std::vector<float> scores, gradients, block_out, keys_t, values_t;  // keys_t, values_t: dK, dV transposed, [H, padded]
};
static thread_local Buffers held;

// The queries whose terms of dK and dV go through the tiles together: 128 deep, so that each
// block of sums is loaded and stored once for four TDPBF16PS of its tiles, not one.
constexpr int64_t kSpan = 4 * kSide;

// Head n's rows of x [B, T, N, H] transposed, [H, length] bfloat16 (length a multiple of 16, at
// least T), zeros past T: 16 rows at a time, a gather of a pair of dimensions each.
static void transposed_rows(const Attention& a, const uint16_t* x, int64_t b, int64_t n, int64_t length, uint16_t* out) {
  const __m512i apart = lanes_apart(a.heads * a.width * 2);
  for (int64_t t = 0; t < length; t += 16) {
    const __mmask16 real = first16(a.queries - t);
    const uint16_t* row = real ? a.query_row(x, b, t, n) : x;
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
    std::memcpy(a.query_row(dq, b, t + i, n), held.block_out.data() + i * a.width, a.width * 4);
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
  const __m512i apart = lanes_apart(a.padded() * 4);
  for (int64_t j = 0; j < a.keys; ++j)
    for (int64_t d = 0; d < a.width; d += 16)
      store(a.key_row(x, b, j, g) + d, _mm512_i32gather_ps(apart, x_t + d * a.padded() + j, 1));
}

static void backward(const Attention& a, const uint16_t* q, const uint16_t* k, const uint16_t* v, const uint16_t* grad,
                     const float* lse, float* dq, float* dk, float* dv, int64_t b, int64_t g) {
  const int64_t keys = a.padded(), length = (a.queries + kSpan - 1) / kSpan * kSpan;
  for (auto* buffer : {&held.key_panels, &held.value_panels, &held.key_columns}) sized(*buffer, keys * a.width);
  for (auto* buffer : {&held.queries, &held.grads}) sized(*buffer, a.width * length);
  for (auto* buffer : {&held.q_rows, &held.g_rows}) sized(*buffer, kSide * a.width);
  for (auto* buffer : {&held.weights, &held.score_gradients, &held.weight_panels, &held.gradient_panels})
    sized(*buffer, kSpan * keys);
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

static ffi::Error FlashBackwardImpl(ffi::ThreadPool pool, Half q, Half k, Half v, Mask mask, Segments query_segments,
                                    Segments key_segments, Single lse, Half grad, ffi::Result<Single> dq,
                                    ffi::Result<Single> dk, ffi::Result<Single> dv, bool causal, int64_t window) {
  return each_key_head(
      pool, q, k, v, mask, query_segments, key_segments, causal, window,
      [&](const auto& a, const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t b, int64_t g) {
        backward(a, q, k, v, bits_of(grad), lse.typed_data(), dq->typed_data(), dk->typed_data(), dv->typed_data(), b, g);
      });
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashBackward, FlashBackwardImpl,
                              operands()
                                  .Arg<Single>()
                                  .Arg<Half>()
                                  .Ret<Single>()
                                  .Ret<Single>()
                                  .Ret<Single>()
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("window"));

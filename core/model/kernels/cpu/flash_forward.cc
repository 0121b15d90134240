// The forward pass of flash.h's attention: a block of 32 queries at a time, its scores on the
// tiles, their softmax on AVX-512 (the probabilities rounded to bfloat16, as XLA rounds them),
// the values weighted on the tiles.
#include "flash.h"

#ifdef APPS_TILES

// Row b's query t over keys [first, last) of its scores (unscaled): the probabilities into
// `weights` as bfloat16 -> their log-sum-exp (-inf where the query sees no key).
static float softmax(const Attention& a, int64_t b, int64_t t, float* scores, uint16_t* weights, int64_t first,
                     int64_t last) {
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

// A thread's buffers for `forward` (`sized`).
struct ForwardBuffers {
  std::vector<uint16_t> key_panels, value_panels, rows, weights;
  std::vector<float> scores, block_out;
};
static thread_local ForwardBuffers held;

static void forward(const Attention& a, const uint16_t* q, const uint16_t* k, const uint16_t* v, float* out, float* lse,
                    int64_t b, int64_t g) {
  const int64_t keys = a.padded();
  uint16_t *key_panels = sized(held.key_panels, keys * a.width), *value_panels = sized(held.value_panels, keys * a.width);
  uint16_t *rows = sized(held.rows, kSide * a.width), *weights = sized(held.weights, kSide * keys);
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
          lse[(b * a.heads + n) * a.queries + t + i] =
              softmax(a, b, t + i, scores + i * keys, weights + i * keys, first, last);
        else
          std::fill(weights + i * keys + first, weights + i * keys + last, 0);
      weighted(a, weights, value_panels, first, last, block_out);
      for (int64_t i = 0; i < kSide && t + i < a.queries; ++i)
        std::memcpy(a.query_row(out, b, t + i, n), block_out + i * a.width, a.width * 4);
    }
}

#endif  // APPS_TILES

static ffi::Error FlashForwardImpl(ffi::ThreadPool pool, Half q, Half k, Half v, Mask mask, Segments query_segments,
                                   Segments key_segments, ffi::Result<Single> out, ffi::Result<Single> lse, bool causal,
                                   int64_t window) {
  return each_key_head(pool, q, k, v, mask, query_segments, key_segments, causal, window,
                       [&](const auto& a, const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t b, int64_t g) {
                         forward(a, q, k, v, out->typed_data(), lse->typed_data(), b, g);
                       });
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashForward, FlashForwardImpl,
                              operands().Ret<Single>().Ret<Single>().Attr<bool>("causal").Attr<int64_t>("window"));

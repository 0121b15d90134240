// One new query per row against its key/value cache on the CPU: the attention of a decoding
// step (core/model/native.py builds this folder; core/model/attention.py's `cached_attention`
// calls it). Rows b < B are rows first + b of a cache of keys [B', K, S, H] and values
// [B', K, H, S] (core/model/cache.py's layout), each holding `lengths[b]` positions; a row's
// query head n (of N, [B, N, H]) reads key head n / G (G = N / K) and its own new key and value
// ([B, K, H]): every slot s < min(length, S) whose position is less than `window` behind the
// query's (every one without a window), and the new key:
//   y[b, n] = sum_s p_s values[.., s] + p_new v[b, n / G],  p = softmax(q . keys / sqrt(H)).
//
// Why a kernel of our own: the step's work is reading the cache, and XLA reads a fixed span of
// slots for every row (the longest row's), copied out of the cache first. Here each row reads
// its own slots alone, where they lie, once for its G query heads; the cache may be float32 or
// bfloat16, widened in registers. Work is split by (row, key head) with `Helper`.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "helper.h"
#include "vectors.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

constexpr float kMasked = -1e30f;  // a slot out of the window's sight: weight e^(-1e30) = 0

// x[k] = e^(x[k] - top) for k < n -> their sum.
static float exponentials(float* x, int64_t n, float top) {
  Vec sum = zero();
  const Vec shift = broadcast(top);
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    const Vec e = exp_negative(sub(load(x + k), shift));
    store(x + k, e);
    sum = add(sum, e);
  }
  float rest = total(sum);
  for (; k < n; ++k) rest += (x[k] = std::exp(x[k] - top));
  return rest;
}

static float largest_of(const float* x, int64_t n, float start) {
  Vec top = broadcast(start);
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) top = max(top, load(x + k));
  float rest = largest(top);
  for (; k < n; ++k) rest = std::max(rest, x[k]);
  return rest;
}

// Asks for the cache lines of p[0, n) ahead of their reading: a row's slots are short runs of
// memory, too short for the hardware's prefetcher (reading 16 rows of SmolLM2's cache: 33 ms
// without, at about half the memory's bandwidth).
constexpr int64_t kAhead = 8;  // key slots ahead
template <typename T>
static inline void ahead(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) _mm_prefetch(bytes + b, _MM_HINT_T0);
}

struct Shape {
  int64_t slots, size, group, window;  // S, H, G, window (0: none)
};

// The G query heads q [G, H] of one row and key head, over its `length` positions -> y [G, H].
template <typename T>
static void heads(const float* q, const float* k, const float* v, const T* keys, const T* values, int64_t length,
                  const Shape& shape, float* y) {
  const int64_t S = shape.slots, H = shape.size, G = shape.group, n = std::min(length, S);
  const float scale = 1.0f / std::sqrt(static_cast<float>(H));
  thread_local std::vector<float> weights;
  weights.resize(G * n);
  for (int64_t s = 0; s < n; ++s) {
    ahead(keys + (s + kAhead) * H, H);
    for (int64_t g = 0; g < G; ++g) weights[g * n + s] = dot(q + g * H, keys + s * H, H) * scale;
  }
  if (shape.window)
    for (int64_t s = 0; s < n; ++s) {
      // Slot s holds the latest position p < length with p mod S = s (core/model/cache.py's `held`).
      const int64_t last = length - 1, position = last - (last - s) % S;
      if (length - position >= shape.window)
        for (int64_t g = 0; g < G; ++g) weights[g * n + s] = kMasked;
    }
  thread_local std::vector<float> mine, inverse;  // each head's own key's weight, 1 / its weights' sum
  mine.resize(G);
  inverse.resize(G);
  for (int64_t g = 0; g < G; ++g) {
    float* w = weights.data() + g * n;
    const float own = dot(q + g * H, k, H) * scale;
    const float top = largest_of(w, n, own);
    mine[g] = std::exp(own - top);
    inverse[g] = 1.0f / (exponentials(w, n, top) + mine[g]);
  }
  ahead(values, n);
  ahead(values + S, n);
  for (int64_t h = 0; h < H; ++h) {
    ahead(values + (h + 2) * S, n);
    for (int64_t g = 0; g < G; ++g)
      y[g * H + h] = (dot(weights.data() + g * n, values + h * S, n) + mine[g] * v[h]) * inverse[g];
  }
}

using Heads = ffi::Buffer<ffi::F32, 3>;
using Scalar = ffi::Buffer<ffi::S32, 0>;
using Lengths = ffi::Buffer<ffi::S32, 1>;

template <typename T>
static void attend(Heads q, Heads k, Heads v, ffi::AnyBuffer keys, ffi::AnyBuffer values, int64_t first,
                   const int32_t* lengths, int64_t window, float* y) {
  const int64_t B = q.dimensions()[0], N = q.dimensions()[1], H = q.dimensions()[2], K = k.dimensions()[1];
  const Shape shape{keys.dimensions()[2], H, N / K, window};
  const int64_t S = shape.slots;
  const T* ks = reinterpret_cast<const T*>(keys.untyped_data());
  const T* vs = reinterpret_cast<const T*>(values.untyped_data());
  const float *qs = q.typed_data(), *kn = k.typed_data(), *vn = v.typed_data();
  const std::function<void(int64_t)> piece = [=](int64_t j) {
    const int64_t b = j / K, head = j % K, row = (first + b) * K + head;
    heads(qs + (b * N + head * shape.group) * H, kn + (b * K + head) * H, vn + (b * K + head) * H,
          ks + row * S * H, vs + row * H * S, lengths[b], shape, y + (b * N + head * shape.group) * H);
  };
  Helper::get().run(B * K, piece);
}

static ffi::Error CachedAttentionImpl(Heads q, Heads k, Heads v, ffi::AnyBuffer keys, ffi::AnyBuffer values,
                                      Scalar first, Lengths lengths, int64_t window,
                                      ffi::Result<Heads> y) {
  const auto qd = q.dimensions(), kd = k.dimensions(), cd = keys.dimensions(), vd = values.dimensions();
  const int64_t B = qd[0], N = qd[1], H = qd[2], K = kd[1];
  if (cd.size() != 4 || vd.size() != 4 || kd[0] != B || kd[2] != H || K == 0 || N % K || cd[1] != K || cd[3] != H ||
      vd[0] != cd[0] || vd[1] != K || vd[2] != H || vd[3] != cd[2] || lengths.dimensions()[0] != B ||
      keys.element_type() != values.element_type())
    return ffi::Error::InvalidArgument(
        "cached_attention: q [B, N, H], k and v [B, K, H], keys [B', K, S, H], values [B', K, H, S] and "
        "lengths [B] disagree");
  const int64_t start = *first.typed_data();
  if (start < 0 || start + B > cd[0]) return ffi::Error::InvalidArgument("cached_attention: rows past the cache");
  const int32_t* ls = lengths.typed_data();
  if (keys.element_type() == ffi::DataType::F32)
    attend<float>(q, k, v, keys, values, start, ls, window, y->typed_data());
  else if (keys.element_type() == ffi::DataType::BF16)
    attend<BFloat16>(q, k, v, keys, values, start, ls, window, y->typed_data());
  else
    return ffi::Error::InvalidArgument("cached_attention: a float32 or bfloat16 cache");
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CachedAttention, CachedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<Heads>()
                                  .Arg<Heads>()
                                  .Arg<Heads>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Scalar>()
                                  .Arg<Lengths>()
                                  .Attr<int64_t>("window")
                                  .Ret<Heads>());

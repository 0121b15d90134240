// The float32 vectors our CPU kernels compute with: AVX-512 where the CPU has it, else AVX2
// with FMA (`-march=native` decides), behind one set of names.
#pragma once

#include <immintrin.h>

#include <cstdint>

// The sum and the largest of eight float32 lanes (AVX2's vectors, and the 256-bit ones of
// kernels that use them on AVX-512 too).
static inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// A bfloat16 number as stored: the high half of a float32's bits.
struct BFloat16 {
  uint16_t bits;
};

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
static inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
static inline Vec load(const BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
// p[0, n) for n < kLanes, zeros after (nothing past them read).
static inline Vec load_part(const float* p, int64_t n) { return _mm512_maskz_loadu_ps((1u << n) - 1, p); }
static inline Vec load_part(const BFloat16* p, int64_t n) {
  const __m256i bits = _mm256_maskz_loadu_epi16((1u << n) - 1, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
static inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
static inline Vec zero() { return _mm512_setzero_ps(); }
static inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float total(Vec v) { return _mm512_reduce_add_ps(v); }
static inline float largest(Vec v) { return _mm512_reduce_max_ps(v); }
static inline Vec broadcast(float v) { return _mm512_set1_ps(v); }
static inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
static inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
static inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
static inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
static inline Vec round_down(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// 2^n for whole n in [-127, 127], built in the exponent bits.
static inline Vec two_to(Vec n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int kLanes = 8;
static inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
static inline Vec load(const BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
static inline Vec load_part(const float* p, int64_t n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes));
}
static inline Vec load_part(const BFloat16* p, int64_t n) {
  alignas(16) BFloat16 part[kLanes] = {};
  for (int64_t k = 0; k < n; ++k) part[k] = p[k];
  return load(part);
}
static inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
static inline Vec zero() { return _mm256_setzero_ps(); }
static inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline Vec broadcast(float v) { return _mm256_set1_ps(v); }
static inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
static inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
static inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
static inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
static inline Vec round_down(Vec v) { return _mm256_floor_ps(v); }
static inline Vec two_to(Vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline float total(Vec v) { return sum8(v); }
static inline float largest(Vec v) { return max8(v); }
#else
#error "our kernels need AVX2 and FMA, or AVX-512"
#endif

// e^x, for x <= 0 (softmax weights after the largest score is taken off), within about 2 units
// in the last place: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor polynomial to r^7,
// times 2^n. Below -87 (e^x under float32's smallest normal) it gives 0.
static inline Vec exp_negative(Vec x) {
  const Vec floor = broadcast(-87.0f);
  const Vec n = round_down(fma(x, broadcast(1.44269504088896341f), broadcast(0.5f)));
  // r = x - n ln 2, ln 2 in two parts so that the product is exact.
  Vec r = fma(n, broadcast(-0.693359375f), x);
  r = fma(n, broadcast(2.12194440e-4f), r);
  Vec p = broadcast(1.0f / 5040);
  p = fma(p, r, broadcast(1.0f / 720));
  p = fma(p, r, broadcast(1.0f / 120));
  p = fma(p, r, broadcast(1.0f / 24));
  p = fma(p, r, broadcast(1.0f / 6));
  p = fma(p, r, broadcast(0.5f));
  p = fma(p, r, broadcast(1.0f));
  p = fma(p, r, broadcast(1.0f));
  const Vec e = mul(p, two_to(max(n, broadcast(-126.0f))));
#if defined(__AVX512F__)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, floor, _CMP_GE_OQ), e);
#else
  return _mm256_and_ps(_mm256_cmp_ps(x, floor, _CMP_GE_OQ), e);
#endif
}

// sum_k a[k] * b[k] for k < n, b float32 or bfloat16.
template <typename T>
static inline float dot(const float* a, const T* b, int64_t n) {
  Vec sum = zero();
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) sum = fma(load(a + k), load(b + k), sum);
  if (k < n) sum = fma(load_part(a + k, n - k), load_part(b + k, n - k), sum);
  return total(sum);
}

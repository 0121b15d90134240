// The operands of bf16_tiles.cc as XLA hands them over (stored as they are or transposed, in
// float32 or bfloat16, stacks of matrices), and the threads that run a kernel's pieces.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// A float32 as bfloat16 bits, rounded to nearest even as XLA converts (a NaN stays a NaN).
static inline uint16_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
static inline uint16_t bits(uint16_t x) { return x; }

// An operand as XLA hands it over: element (i, j) of a [rows, columns] matrix lies at
// data[i * columns + j], or at data[j * rows + i] when it is stored transposed (a layer's weight
// read as its transpose for the input's gradient, the input read as its transpose for the weight's).
template <class T>
struct Operand {
  const T* data;
  int64_t rows, columns;
  bool transposed;
  uint16_t at(int64_t i, int64_t j) const { return bits(data[transposed ? j * rows + i : i * columns + j]); }
  Operand matrix(int64_t m) const { return {data + m * rows * columns, rows, columns, transposed}; }
};

// The first `count` of 16 lanes (none from zero down, all from 16 up).
static inline __mmask16 first16(int64_t count) { return __mmask16(count >= 16 ? 0xffff : (1u << std::max<int64_t>(count, 0)) - 1); }

// Pieces 0 .. n - 1 of `body` on the calling thread and on XLA's intra-op threads, which run
// the step's other operations too. The calling thread returns once every piece is done; a task
// that starts later finds none left.
static void run(ffi::ThreadPool& pool, int64_t n, const std::function<void(int64_t)>& body) {
  struct Pieces {
    const std::function<void(int64_t)>* body;
    int64_t n;
    std::atomic<int64_t> next{0}, done{0};
  };
  auto pieces = std::make_shared<Pieces>();
  pieces->body = &body;
  pieces->n = n;
  const auto work = [pieces] {
    for (int64_t k; (k = pieces->next.fetch_add(1)) < pieces->n; pieces->done.fetch_add(1)) (*pieces->body)(k);
  };
  for (int64_t t = 1; t < std::min<int64_t>(n, pool.num_threads()); ++t) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  while (pieces->done.load(std::memory_order_acquire) < n) _mm_pause();
}

// A buffer [..., R, C] as a stack of matrices: how many, and R and C.
struct Stack {
  int64_t count = 1, first = 0, second = 0;
  explicit Stack(ffi::Span<const int64_t> shape) {
    for (size_t i = 0; i + 2 < shape.size(); ++i) count *= shape[i];
    if (shape.size() >= 2) first = shape[shape.size() - 2], second = shape[shape.size() - 1];
  }
};

// body(operand) with matrix 0 of `buffer` as the Operand of its element type, [rows, columns] as
// the product reads it (stored [columns, rows] when `transposed`); false for an element type other
// than float32 and bfloat16.
template <class F>
static bool as_operand(const ffi::AnyBuffer& buffer, bool transposed, F&& body) {
  const Stack shape(buffer.dimensions());
  const int64_t rows = transposed ? shape.second : shape.first, columns = transposed ? shape.first : shape.second;
  if (buffer.element_type() == ffi::DataType::F32)
    body(Operand<float>{reinterpret_cast<const float*>(buffer.untyped_data()), rows, columns, transposed});
  else if (buffer.element_type() == ffi::DataType::BF16)
    body(Operand<uint16_t>{reinterpret_cast<const uint16_t*>(buffer.untyped_data()), rows, columns, transposed});
  else
    return false;
  return true;
}


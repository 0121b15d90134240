// Bfloat16 products with float32 sums on Intel's AMX tiles, for the large products of a
// training step (core/model/native.py builds this folder and registers it with XLA;
// core/model/native_products.py calls it):
//   tile_columns: B [..., K, N] (float32 or bfloat16, each matrix stored as it is or transposed)
//                 -> B in bfloat16, zeros to whole tiles, laid out as the tiles read it,
//                 [..., N/32, K/2, 64];
//   tile_product: A [..., M, K] (the same kinds) times such a B -> C [..., M, N] float32.
//
// Why a kernel of our own: XLA:CPU multiplies bfloat16 through YNNPACK, which does not use AMX
// on this jaxlib (1,111-1,461 GFLOP/s on two Sapphire Rapids cores at 2,048 x 576 x 1,536,
// where torch's oneDNN reaches 2,875); no flag of XLA routes a product to oneDNN's AMX code.
// One TDPBF16PS multiplies a 16 x 32 tile of A by a 32 x 16 one of B into 16 x 16 float32
// sums; a block of 32 x 32 outputs keeps its four sums in tiles 0-3 while two tiles of A (4,
// 5) and two of B (6, 7) stream through K, four products for four loads. A is copied once per
// call into bfloat16 rows padded to whole tiles (tile loads across two cache lines run at two
// thirds of the speed); B's columns go in panels of 32 whose K/2 rows hold pairs of B's rows
// side by side, as TDPBF16PS reads them. Reading an operand transposed, as XLA hands over a
// weight for its input's gradient and an input for its weight's, is a gather in that copy:
// XLA's own transposed copies had cost more than the products saved. Blocks run a group of
// panels that stays in the core's L2 against each block of A's rows in turn, the depth in
// spans of 2,048. Every bfloat16 is rounded to nearest even from float32, as XLA converts, and
// each product of two is exact in float32: only the order of the float32 sums differs from XLA's.
// The pieces run on XLA's intra-op threads (`run`): a thread of our own competed with XLA's
// other operations, and the step ran 12% slower than with XLA's products.
#include <sys/syscall.h>
#include <unistd.h>

#include "tiles.h"

constexpr int64_t kDepth = 2048;  // the depth of A's rows and B's panels that a block reads at a time

// Whether this process may use the tiles: Linux hands them out on request, once a process.
extern "C" int apps_tiles_ready() {
#ifdef APPS_TILES
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const int ready = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return ready;
#else
  return 0;
#endif
}

#ifdef APPS_TILES

// Row i's values j .. j + 31 of a transposed operand (up to the end of the row), 16 lanes a
// gather each (float32; bfloat16 one at a time).
static inline __m512i gathered32(const Operand<float>& a, int64_t i, int64_t j) {
  const __m512i apart = lanes_apart(a.rows);
  const float* base = a.data + j * a.rows + i;
  const __m512 low = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), first16(a.columns - j), apart, base, 4);
  const __m512 high = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), first16(a.columns - j - 16), apart,
                                               base + 16 * a.rows, 4);
  return __m512i(_mm512_cvtne2ps_pbh(high, low));
}
static inline __m512i gathered32(const Operand<uint16_t>& a, int64_t i, int64_t j) {
  alignas(64) uint16_t values[32];
  for (int64_t t = 0; t < 32; ++t) values[t] = j + t < a.columns ? a.at(i, j + t) : 0;
  return _mm512_load_si512(values);
}

// Rows [begin, end) of A [M, K] as bfloat16 rows of `width` (K rounded up to 32), zeros beyond.
// A transposed A goes 32 of its stored rows at a time, each gather reading a cache line of each
// that the next 15 rows of the copy read again.
template <class T>
static void copy_rows(const Operand<T>& a, int64_t width, uint16_t* out, int64_t begin, int64_t end) {
  for (int64_t k = 0; k < width; k += kSide)
    for (int64_t r = begin; r < end; ++r) {
      __m512i values = _mm512_setzero_si512();
      if (r < a.rows) values = a.transposed ? gathered32(a, r, k) : row32(a.data + r * a.columns + k, a.columns - k);
      _mm512_storeu_si512(out + r * width + k, values);
    }
}

// Row j of a panel from a transposed B: for 16 columns from n, the pair (B[2j, n + c], B[2j + 1, n + c])
// lies at data[(n + c) * K + 2j], two values in a row (a 64-bit gather of two float32, a 32-bit of two bfloat16).
static inline __m512i pairs16(const Operand<float>& b, int64_t j, int64_t n) {
  const __m256i apart = _mm256_mullo_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_epi32(int32_t(b.rows)));
  const float* base = b.data + n * b.rows + 2 * j;
  const __mmask16 valid = first16(b.columns - n);
  const __m512i low = _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), __mmask8(valid), apart, base, 4);
  const __m512i high = _mm512_mask_i32gather_epi64(_mm512_setzero_si512(), __mmask8(valid >> 8), apart,
                                                   base + 8 * b.rows, 4);
  return __m512i(_mm512_cvtne2ps_pbh(_mm512_castsi512_ps(high), _mm512_castsi512_ps(low)));
}
static inline __m512i pairs16(const Operand<uint16_t>& b, int64_t j, int64_t n) {
  const __m512i apart = lanes_apart(b.rows);
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), first16(b.columns - n), apart, b.data + n * b.rows + 2 * j, 2);
}

// Panels [begin, end) of B [K, N]: panel p holds columns 32p .. 32p + 31, row j of it the
// columns' values at rows 2j and 2j + 1 of B side by side (64 bfloat16).
template <class T>
static void copy_panels(const Operand<T>& b, uint16_t* out, int64_t begin, int64_t end) {
  const int64_t depth = b.rows, columns = b.columns, pairs = whole(depth) / 2;
  for (int64_t p = begin; p < end; ++p) {
    const int64_t n = p * kSide, count = std::min(kSide, columns - n);
    uint16_t* panel = out + p * pairs * 2 * kSide;
    for (int64_t j = 0; j < pairs; ++j) {
      const int64_t k = 2 * j;
      if (b.transposed && k + 1 < depth) {
        _mm512_storeu_si512(panel + j * 64, pairs16(b, j, n));
        _mm512_storeu_si512(panel + j * 64 + 32, pairs16(b, j, n + 16));
      } else if (b.transposed) {  // a lone last row, or the zeros past it
        for (int64_t c = 0; c < kSide; ++c)
          panel[j * 64 + 2 * c] = k < depth && c < count ? b.at(k, n + c) : 0, panel[j * 64 + 2 * c + 1] = 0;
      } else {
        const __m512i even = k < depth ? row32(b.data + k * columns + n, count) : _mm512_setzero_si512();
        const __m512i odd = k + 1 < depth ? row32(b.data + (k + 1) * columns + n, count) : _mm512_setzero_si512();
        paired(even, odd, panel + j * 64);
      }
    }
  }
}

// C's blocks of rows [row_begin, row_end) and panels [panel_begin, panel_end), the depth in
// spans of `kDepth` (each block's sums go back to C between spans, so that a span of A's rows
// and of the panels stays in cache however deep the product). A block on C's edge goes whole
// through a buffer, of which only C's part is copied.
static void blocks(const uint16_t* a, const uint16_t* panels, float* c, int64_t rows, int64_t columns, int64_t width,
                   int64_t row_begin, int64_t row_end, int64_t panel_begin, int64_t panel_end) {
  alignas(64) float edge[kSide * kSide];
  configure();
  const auto inside = [&](int64_t r, int64_t p) { return r + kSide <= rows && (p + 1) * kSide <= columns; };
  for (int64_t span = 0; span < width; span += kDepth)
    for (int64_t r = row_begin; r < row_end; r += kSide)
      for (int64_t p = panel_begin; p < panel_end; ++p)
        if (inside(r, p))
          block(a + r * width, width, panels + p * width * kSide, span, std::min(width, span + kDepth),
                c + r * columns + p * kSide, columns, span > 0);
  for (int64_t r = row_begin; r < row_end; r += kSide)
    for (int64_t p = panel_begin; p < panel_end; ++p) {
      if (inside(r, p)) continue;
      const int64_t height = std::min(kSide, rows - r), count = std::min(kSide, columns - p * kSide);
      block(a + r * width, width, panels + p * width * kSide, 0, width, edge, kSide, false);
      for (int64_t i = 0; i < height; ++i) std::memcpy(c + (r + i) * columns + p * kSide, edge + i * kSide, count * 4);
    }
  _tile_release();
}

#endif  // APPS_TILES

// A panel group's bytes: what stays in L2 while blocks of A's rows go by.
constexpr int64_t kGroupBytes = 320 * 1024;

// Pieces of (a matrix of the stack, a group of panels, a range of blocks of rows) for the
// threads: at least 16, so that they finish together.
static void split(ffi::ThreadPool& pool, int64_t matrices, int64_t rows, int64_t panels, int64_t width,
                  const std::function<void(int64_t, int64_t, int64_t, int64_t, int64_t)>& body) {
  const int64_t per_group = std::max<int64_t>(1, kGroupBytes / (std::min(width, kDepth) * kSide * 2));
  const int64_t groups = (panels + per_group - 1) / per_group, step = (panels + groups - 1) / groups;
  const int64_t row_blocks = (rows + kSide - 1) / kSide;
  const int64_t parts = std::min(row_blocks, std::max<int64_t>(1, (16 + matrices * groups - 1) / (matrices * groups)));
  run(pool, matrices * groups * parts, [&](int64_t k) {
    const int64_t m = k / (groups * parts), g = k / parts % groups, part = k % parts;
    const int64_t first = row_blocks * part / parts, last = row_blocks * (part + 1) / parts;
    body(m, first * kSide, std::min(rows, last * kSide), g * step, std::min(panels, (g + 1) * step));
  });
}

using Panels = ffi::Buffer<ffi::BF16>;
using Sums = ffi::Buffer<ffi::F32>;
using Rows = ffi::Buffer<ffi::BF16>;

static ffi::Error Unsupported() {
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "bf16_tiles: this library was built for a CPU without AMX");
}

static ffi::Error TileColumnsImpl(ffi::ThreadPool pool, ffi::AnyBuffer b, ffi::Result<Panels> panels, bool transposed) {
#ifdef APPS_TILES
  const Stack shape(b.dimensions()), out(panels->dimensions());
  const int64_t depth = transposed ? shape.second : shape.first, columns = transposed ? shape.first : shape.second;
  const int64_t count = (columns + kSide - 1) / kSide, size = whole(depth) * kSide * count;
  if (b.dimensions().size() < 2 || out.count != shape.count * count || out.first != whole(depth) / 2 || out.second != 2 * kSide)
    return ffi::Error::InvalidArgument("tile_columns: panels are [..., ceil(N / 32), ceil(K / 32) * 16, 64] for B [..., K, N]");
  auto* to = reinterpret_cast<uint16_t*>(panels->typed_data());
  const int64_t total = shape.count * count, pieces = std::min<int64_t>(16, total);
  const bool typed = as_operand(b, transposed, [&](const auto& operand) {
    run(pool, pieces, [&](int64_t k) {
      for (int64_t g = total * k / pieces; g < total * (k + 1) / pieces; ++g)
        copy_panels(operand.matrix(g / count), to + g / count * size, g % count, g % count + 1);
    });
  });
  return typed ? ffi::Error::Success() : ffi::Error::InvalidArgument("tile_columns: B is float32 or bfloat16");
#else
  return Unsupported();
#endif
}

static ffi::Error TileProductImpl(ffi::ThreadPool pool, ffi::AnyBuffer a, Panels panels, ffi::Result<Sums> c,
                                  ffi::Result<Rows> rows_copy, bool transposed) {
#ifdef APPS_TILES
  const Stack shape(a.dimensions()), sums(c->dimensions()), tiles(panels.dimensions()), copied(rows_copy->dimensions());
  const int64_t rows = transposed ? shape.second : shape.first, depth = transposed ? shape.first : shape.second;
  const int64_t width = whole(depth), columns = sums.second, count = (columns + kSide - 1) / kSide;
  if (a.dimensions().size() < 2 || sums.count != shape.count || sums.first != rows ||
      tiles.count != shape.count * count || tiles.first * 2 != width || copied.count != shape.count ||
      copied.first != whole(rows) || copied.second != width)
    return ffi::Error::InvalidArgument("tile_product: A [..., M, K], B's panels of tile_columns and C [..., M, N] disagree");
  auto* copy = reinterpret_cast<uint16_t*>(rows_copy->typed_data());
  const int64_t per = std::max<int64_t>(1, (16 + shape.count - 1) / shape.count), size = whole(rows) * width;
  const bool typed = as_operand(a, transposed, [&](const auto& operand) {
    run(pool, shape.count * per, [&](int64_t k) {
      const int64_t m = k / per, part = k % per;
      copy_rows(operand.matrix(m), width, copy + m * size, whole(rows) * part / per, whole(rows) * (part + 1) / per);
    });
  });
  if (!typed) return ffi::Error::InvalidArgument("tile_product: A is float32 or bfloat16");
  const auto* from = reinterpret_cast<const uint16_t*>(panels.typed_data());
  float* to = c->typed_data();
  split(pool, shape.count, rows, count, width, [&](int64_t m, int64_t row_begin, int64_t row_end, int64_t first, int64_t last) {
    blocks(copy + m * size, from + m * width * kSide * count, to + m * rows * columns, rows, columns, width, row_begin,
           row_end, first, last);
  });
  return ffi::Error::Success();
#else
  return Unsupported();
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(TileColumns, TileColumnsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<Panels>()
                                  .Attr<bool>("transposed"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(TileProduct, TileProductImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<Panels>()
                                  .Ret<Sums>()
                                  .Ret<Rows>()
                                  .Attr<bool>("transposed"));

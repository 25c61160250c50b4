// lazy_optax's CPU row kernels, called from JAX through XLA's FFI.
//
// XLA CPU reads rows that are not in cache about 3x slower in its gathers and
// scatters than a plain row copy does, and a lazy optimizer step is mostly
// such reads. These kernels move whole rows, prefetching a few slots ahead,
// and update state tables in place (the outputs alias the inputs, so with
// donated buffers XLA hands the same memory back and only the touched rows
// are read or written).
//
// Tables are `[R, W]` (a row of W values, any row shape flattened). Ids are
// int32; an id outside [0, R) names no row: it reads zeros and writes
// nothing. Rows given to the rule kernels are distinct (lazy(...) has summed
// duplicates), so the threads of one call write disjoint rows.
//
// Storage dtypes: float32 and bfloat16 for tables and moments; gradients and
// updates are float32 (the caller casts). Arithmetic is float32, rounded to
// the storage dtype to nearest even, as XLA's convert does.
//
// Handlers (Python wrappers in __init__.py say what each returns):
//   LazyOptaxDedup          distinct ids (ascending) and summed rows
//   LazyOptaxGather         table[ids]
//   LazyOptaxScatter        table[ids] = rows           (in place)
//   LazyOptaxScatterAdd     table[ids] += rows          (in place)
//   LazyOptaxAddStochastic  the same into bfloat16, stochastically rounded
//   LazyOptaxAdam           TensorFlow's Adam rule (epsilon hat)
//   LazyOptaxAmsgrad        the same with the running maximum of nu
//   LazyOptaxRowwiseAdagrad one accumulator per row (FBGEMM's rule)
//   LazyOptaxPartialRowwiseAdam  mu per entry, nu per row (FBGEMM's rule)
//   LazyOptaxFtrl           FTRL-Proximal (TensorFlow's ApplyFtrlV2)

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPrefetchAhead = 8;
// Row loops are split into chunks of kChunkRows slots, shared out over XLA's
// intra-op thread pool when it has several threads and the call touches at
// least kParallelMinValues values.
constexpr int64_t kChunkRows = 128;
constexpr int64_t kParallelMinValues = 1 << 16;

// ---------------------------------------------------------------------------
// Storage dtypes.

inline float Bf16ToF32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a (quiet) NaN
    return static_cast<uint16_t>((u >> 16) | 0x40u);
  }
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);  // to nearest even
  return static_cast<uint16_t>((u + rounding) >> 16);
}

// Load/Store convert between the storage dtype and float32; Rounded(x) is
// what Load gives back after Store(x), computed without the memory round
// trip (so loops over rows vectorize).
struct F32 {
  using T = float;
  static float Load(const float* p) { return *p; }
  static void Store(float* p, float x) { *p = x; }
  static float Rounded(float x) { return x; }
};

struct BF16 {
  using T = uint16_t;
  static float Load(const uint16_t* p) { return Bf16ToF32(*p); }
  static void Store(uint16_t* p, float x) { *p = F32ToBf16(x); }
  static float Rounded(float x) { return Bf16ToF32(F32ToBf16(x)); }
};

// Calls fn.template operator()<S>() with S = F32 or BF16 for `type`.
template <typename Fn>
ffi::Error WithStorage(ffi::DataType type, Fn&& fn) {
  switch (type) {
    case ffi::DataType::F32:
      return fn(F32{});
    case ffi::DataType::BF16:
      return fn(BF16{});
    default:
      return ffi::Error::InvalidArgument(
          "lazy_optax row kernel: tables must be float32 or bfloat16");
  }
}

// ---------------------------------------------------------------------------
// Shapes.

// A `[rows, width]` view of a buffer of rank >= 1 (a rank-1 buffer has rows
// of one value).
struct Shape2 {
  int64_t rows = 0;
  int64_t width = 1;
};

Shape2 AsRows(ffi::AnyBuffer::Dimensions dims) {
  Shape2 s;
  if (dims.size() == 0) return Shape2{1, 1};
  s.rows = dims[0];
  for (size_t k = 1; k < dims.size(); ++k) s.width *= dims[k];
  return s;
}

inline bool Named(int32_t id, int64_t rows) { return id >= 0 && id < rows; }

// ---------------------------------------------------------------------------
// A loop over slots, shared over XLA's intra-op thread pool.
//
// Chunks are claimed from a shared counter by the caller and by any helper
// task that starts in time; the caller waits only for chunks already claimed
// (being worked on), never for a task that has not started, so a busy pool
// cannot deadlock it. Late helpers find no chunk and return; the shared
// state lives as long as the last of them.

template <typename Fn>
struct Chunks {
  Fn fn;
  int64_t n;
  int64_t count;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  Chunks(Fn f, int64_t slots)
      : fn(std::move(f)), n(slots), count((slots + kChunkRows - 1) / kChunkRows) {}

  void Work() {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= count) return;
      fn(c * kChunkRows, std::min(n, (c + 1) * kChunkRows));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t values_per_slot,
                 Fn fn) {
  const int64_t threads = pool.num_threads();
  if (threads <= 1 || n * values_per_slot < kParallelMinValues) {
    fn(int64_t{0}, n);
    return;
  }
  auto chunks = std::make_shared<Chunks<Fn>>(std::move(fn), n);
  const int64_t helpers = std::min(threads, chunks->count) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([chunks] { chunks->Work(); });
  }
  chunks->Work();
  while (chunks->done.load(std::memory_order_acquire) < chunks->count) {
    std::this_thread::yield();
  }
}

inline void Prefetch(const void* base, int64_t row, int64_t row_bytes,
                     bool write) {
  const char* p = static_cast<const char*>(base) + row * row_bytes;
  for (int64_t k = 0; k < row_bytes; k += 64) {
    if (write) {
      __builtin_prefetch(p + k, 1);
    } else {
      __builtin_prefetch(p + k, 0);
    }
  }
}

// The output of an in-place kernel: XLA aliases it to the input; copy only
// if it ever did not.
void* InPlace(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  void* dst = out->untyped_data();
  if (dst != in.untyped_data()) {
    std::memcpy(dst, in.untyped_data(), in.size_bytes());
  }
  return dst;
}

// ---------------------------------------------------------------------------
// Deduplication: distinct ids in ascending order and the sum of their rows.

uint32_t HashBits(int64_t n) {
  uint32_t bits = 1;
  while ((int64_t{1} << bits) < 2 * n) ++bits;
  return bits;
}

inline uint32_t Bucket(int32_t id, uint32_t bits) {
  return (static_cast<uint32_t>(id) * 0x9E3779B1u) >> (32 - bits);
}

// Sorts `keys` (id << 32 | slot, ids in [0, 2^31)) by id: a stable LSD radix
// sort on the id's bits, 11 at a time, as many passes as `num_rows` needs.
void SortById(std::vector<uint64_t>& keys, std::vector<uint64_t>& scratch,
              int64_t num_rows) {
  constexpr int kBits = 11;
  constexpr int64_t kBuckets = int64_t{1} << kBits;
  int id_bits = 1;
  while ((int64_t{1} << id_bits) < num_rows) ++id_bits;
  scratch.resize(keys.size());
  int64_t count[kBuckets];
  for (int shift = 32; shift < 32 + id_bits; shift += kBits) {
    std::fill(count, count + kBuckets, 0);
    for (uint64_t key : keys) ++count[(key >> shift) & (kBuckets - 1)];
    int64_t total = 0;
    for (int64_t b = 0; b < kBuckets; ++b) {
      const int64_t c = count[b];
      count[b] = total;
      total += c;
    }
    for (uint64_t key : keys) {
      scratch[count[(key >> shift) & (kBuckets - 1)]++] = key;
    }
    keys.swap(scratch);
  }
}

template <typename S>
void SumRows(const int32_t* ids, const typename S::T* values, int64_t n,
             int64_t width, int64_t num_rows, int32_t* unique,
             typename S::T* summed) {
  // Scratch kept per thread between calls (no allocation in the step).
  thread_local std::vector<int32_t> table, slot_of, rank;
  thread_local std::vector<uint64_t> keys, scratch;
  thread_local std::vector<float> acc;
  const uint32_t bits = HashBits(n);
  const uint32_t mask = (uint32_t{1} << bits) - 1;
  // Bucket -> (first position of the id, as its slot); then each position's
  // slot, in order of first appearance.
  table.assign(size_t{1} << bits, -1);
  slot_of.assign(n, -1);
  keys.clear();
  for (int64_t i = 0; i < n; ++i) {
    const int32_t r = ids[i];
    if (!Named(r, num_rows)) continue;
    uint32_t b = Bucket(r, bits);
    while (table[b] >= 0 &&
           static_cast<int32_t>(keys[table[b]] >> 32) != r) {
      b = (b + 1) & mask;
    }
    if (table[b] < 0) {
      table[b] = static_cast<int32_t>(keys.size());
      keys.push_back((static_cast<uint64_t>(r) << 32) | keys.size());
    }
    slot_of[i] = table[b];
  }
  const int64_t k = static_cast<int64_t>(keys.size());
  SortById(keys, scratch, num_rows);
  rank.resize(k);
  for (int64_t j = 0; j < k; ++j) {
    unique[j] = static_cast<int32_t>(keys[j] >> 32);
    rank[keys[j] & 0xffffffffu] = static_cast<int32_t>(j);
  }
  for (int64_t j = k; j < n; ++j) unique[j] = static_cast<int32_t>(num_rows);
  // Sums in float32, rounded once at the end for 16-bit values.
  float* out;
  if constexpr (std::is_same_v<S, F32>) {
    out = summed;
  } else {
    acc.resize(static_cast<size_t>(k * width));
    out = acc.data();
  }
  std::memset(out, 0, static_cast<size_t>(k * width) * sizeof(float));
  for (int64_t i = 0; i < n; ++i) {
    if (slot_of[i] < 0) continue;
    float* __restrict__ a = out + static_cast<int64_t>(rank[slot_of[i]]) * width;
    const typename S::T* __restrict__ v = values + i * width;
    for (int64_t c = 0; c < width; ++c) a[c] += S::Load(v + c);
  }
  if constexpr (!std::is_same_v<S, F32>) {
    for (int64_t e = 0; e < k * width; ++e) S::Store(summed + e, acc[e]);
  }
  std::memset(static_cast<void*>(summed + k * width), 0,
              static_cast<size_t>((n - k) * width) * sizeof(typename S::T));
}

ffi::Error Dedup(ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer values,
                 ffi::Result<ffi::Buffer<ffi::S32>> unique,
                 ffi::Result<ffi::AnyBuffer> summed, int64_t num_rows) {
  const Shape2 v = AsRows(values.dimensions());
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (v.rows != n || summed->element_type() != values.element_type()) {
    return ffi::Error::InvalidArgument("LazyOptaxDedup: operand shapes");
  }
  return WithStorage(values.element_type(), [&](auto s) {
    using S = decltype(s);
    SumRows<S>(ids.typed_data(),
               static_cast<const typename S::T*>(values.untyped_data()), n,
               v.width, num_rows, unique->typed_data(),
               static_cast<typename S::T*>(summed->untyped_data()));
    return ffi::Error::Success();
  });
}

// ---------------------------------------------------------------------------
// After: `x`, once `after` exists. It orders a table's in-place update after
// the lookups that read the table (XLA keeps an unknown call's operands),
// where nothing else does (a loss linear in the rows).

ffi::Error After(ffi::AnyBuffer x, ffi::AnyBuffer after,
                 ffi::Result<ffi::AnyBuffer> out) {
  (void)after;
  InPlace(x, out);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Row movement: gather, scatter (set) and scatter-add.

ffi::Error Gather(ffi::ThreadPool pool, ffi::AnyBuffer table,
                  ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> out) {
  const Shape2 t = AsRows(table.dimensions());
  const int64_t n = static_cast<int64_t>(ids.element_count());
  const int64_t row_bytes =
      t.width * static_cast<int64_t>(ffi::ByteWidth(table.element_type()));
  if (out->element_type() != table.element_type() ||
      static_cast<int64_t>(out->size_bytes()) != n * row_bytes) {
    return ffi::Error::InvalidArgument("LazyOptaxGather: operand shapes");
  }
  const char* src = static_cast<const char*>(table.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t* id = ids.typed_data();
  ParallelFor(pool, n, t.width, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      if (s + kPrefetchAhead < end && Named(id[s + kPrefetchAhead], t.rows)) {
        Prefetch(src, id[s + kPrefetchAhead], row_bytes, false);
      }
      if (Named(id[s], t.rows)) {
        std::memcpy(dst + s * row_bytes, src + id[s] * row_bytes, row_bytes);
      } else {
        std::memset(dst + s * row_bytes, 0, row_bytes);
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error Scatter(ffi::ThreadPool pool, ffi::AnyBuffer table,
                   ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer rows,
                   ffi::Result<ffi::AnyBuffer> out) {
  const Shape2 t = AsRows(table.dimensions());
  const int64_t n = static_cast<int64_t>(ids.element_count());
  const int64_t row_bytes =
      t.width * static_cast<int64_t>(ffi::ByteWidth(table.element_type()));
  if (rows.element_type() != table.element_type() ||
      static_cast<int64_t>(rows.size_bytes()) != n * row_bytes) {
    return ffi::Error::InvalidArgument("LazyOptaxScatter: operand shapes");
  }
  char* dst = static_cast<char*>(InPlace(table, out));
  const char* src = static_cast<const char*>(rows.untyped_data());
  const int32_t* id = ids.typed_data();
  // Ids are distinct (or name no row), so chunks write disjoint rows.
  ParallelFor(pool, n, t.width, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      if (s + kPrefetchAhead < end && Named(id[s + kPrefetchAhead], t.rows)) {
        Prefetch(dst, id[s + kPrefetchAhead], row_bytes, true);
      }
      if (Named(id[s], t.rows)) {
        std::memcpy(dst + id[s] * row_bytes, src + s * row_bytes, row_bytes);
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error ScatterAdd(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids,
                      ffi::AnyBuffer rows, ffi::Result<ffi::AnyBuffer> out) {
  const Shape2 t = AsRows(table.dimensions());
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (rows.element_type() != table.element_type() ||
      static_cast<int64_t>(rows.element_count()) != n * t.width) {
    return ffi::Error::InvalidArgument("LazyOptaxScatterAdd: operand shapes");
  }
  void* dst = InPlace(table, out);
  const int32_t* id = ids.typed_data();
  // One thread: ids may repeat here (user-built updates), and the sums of a
  // repeated id are added in slot order.
  return WithStorage(table.element_type(), [&](auto s) {
    using S = decltype(s);
    using T = typename S::T;
    T* p = static_cast<T*>(dst);
    const T* u = static_cast<const T*>(rows.untyped_data());
    const int64_t row_bytes = t.width * static_cast<int64_t>(sizeof(T));
    for (int64_t k = 0; k < n; ++k) {
      if (k + kPrefetchAhead < n && Named(id[k + kPrefetchAhead], t.rows)) {
        Prefetch(p, id[k + kPrefetchAhead], row_bytes, true);
      }
      if (!Named(id[k], t.rows)) continue;
      T* row = p + static_cast<int64_t>(id[k]) * t.width;
      const T* add = u + k * t.width;
      for (int64_t c = 0; c < t.width; ++c) {
        S::Store(row + c, S::Load(row + c) + S::Load(add + c));
      }
    }
    return ffi::Error::Success();
  });
}

// ---------------------------------------------------------------------------
// Stochastic rounding into bfloat16 tables, with the random bits of
// `lazy_optax.apply_updates_stochastic`: JAX's threefry-2x32 generator
// (jax.random.fold_in, then jax.random.uniform over the row's entries, with
// JAX's default partitionable bit layout).

inline uint32_t Rotl(uint32_t v, int d) { return (v << d) | (v >> (32 - d)); }

// Threefry-2x32 (20 rounds) of the counter (x0, x1) under key (k0, k1).
inline void Threefry(uint32_t k0, uint32_t k1, uint32_t& x0, uint32_t& x1) {
  static constexpr int kRot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  x0 += ks[0];
  x1 += ks[1];
  for (uint32_t i = 0; i < 5; ++i) {
    for (int j = 0; j < 4; ++j) {
      x0 += x1;
      x1 = Rotl(x1, kRot[i % 2][j]);
      x1 ^= x0;
    }
    x0 += ks[(i + 1) % 3];
    x1 += ks[(i + 2) % 3] + i + 1;
  }
}

// A uniform float in [0, 1) from 32 random bits, as jax.random.uniform.
inline float UnitFloat(uint32_t bits) {
  const uint32_t f = (bits >> 9) | 0x3f800000u;
  float x;
  std::memcpy(&x, &f, sizeof(x));
  return x - 1.0f;
}

// The bfloat16 next to h toward +inf (up) or -inf.
inline uint16_t NextBf16(uint16_t h, bool up) {
  if ((h & 0x7fffu) == 0) return up ? 0x0001u : 0x8001u;
  const bool negative = (h & 0x8000u) != 0;
  return static_cast<uint16_t>(up != negative ? h + 1 : h - 1);
}

// x rounded to bfloat16 up or down, taking the far neighbour with
// probability (x - nearest) / (far - nearest) against u; saturates past the
// largest finite bfloat16; NaN and infinities pass through.
inline uint16_t RoundStochastic(float x, float u) {
  uint16_t nearest = F32ToBf16(x);
  if (!std::isfinite(x)) return nearest;
  float near = Bf16ToF32(nearest);
  uint16_t other;
  if (std::isinf(near)) {  // past the largest finite value: saturate
    nearest = static_cast<uint16_t>((nearest & 0x8000u) | 0x7f7fu);
    near = Bf16ToF32(nearest);
    other = nearest;
  } else {
    other = NextBf16(nearest, !(near > x));
  }
  const float gap = Bf16ToF32(other) - near;
  const float prob = gap != 0.0f ? (x - near) / gap : 0.0f;
  return u < prob ? other : nearest;
}

ffi::Error AddStochastic(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids,
                         ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::U32> key,
                         ffi::Result<ffi::AnyBuffer> out) {
  const Shape2 t = AsRows(table.dimensions());
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (table.element_type() != ffi::DataType::BF16 ||
      static_cast<int64_t>(rows.element_count()) != n * t.width ||
      key.element_count() != 2) {
    return ffi::Error::InvalidArgument("LazyOptaxAddStochastic: operands");
  }
  uint16_t* p = static_cast<uint16_t*>(InPlace(table, out));
  const int32_t* id = ids.typed_data();
  const float* u = rows.typed_data();
  const uint32_t k0 = key.typed_data()[0], k1 = key.typed_data()[1];
  const int64_t w = t.width;
  for (int64_t s = 0; s < n; ++s) {
    if (s + kPrefetchAhead < n && Named(id[s + kPrefetchAhead], t.rows)) {
      Prefetch(p, id[s + kPrefetchAhead], w * 2, true);
    }
    if (!Named(id[s], t.rows)) continue;
    // fold_in(key, row id), then one counter (0, k) per entry k.
    uint32_t r0 = 0, r1 = static_cast<uint32_t>(id[s]);
    Threefry(k0, k1, r0, r1);
    uint16_t* row = p + static_cast<int64_t>(id[s]) * w;
    const float* add = u + s * w;
    for (int64_t k = 0; k < w; ++k) {
      uint32_t b0 = 0, b1 = static_cast<uint32_t>(k);
      Threefry(r0, r1, b0, b1);
      row[k] = RoundStochastic(Bf16ToF32(row[k]) + add[k],
                               UnitFloat(b0 ^ b1));
    }
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Rule kernels. Each reads the gradient rows `g` [N, W] (float32) of distinct
// ids, updates its state tables in place at those rows, and writes the step
// of each slot to `updates` [N, W] (float32; zeros where the id names no row).

struct RuleIo {
  const int32_t* ids;
  const float* g;
  float* out;
  int64_t n;
  int64_t width;
  int64_t rows;
};

// Checks the operands shared by every rule kernel; `table_rows` is the row
// count of the first state table.
ffi::Error CheckRule(const char* name, ffi::Buffer<ffi::S32>& ids,
                     ffi::Buffer<ffi::F32>& g,
                     ffi::Result<ffi::Buffer<ffi::F32>>& updates,
                     RuleIo& io, int64_t table_rows) {
  const Shape2 gs = AsRows(g.dimensions());
  io.n = static_cast<int64_t>(ids.element_count());
  io.width = gs.width;
  io.rows = table_rows;
  if (gs.rows != io.n || updates->element_count() != g.element_count()) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": gradient and update shapes");
  }
  io.ids = ids.typed_data();
  io.g = g.typed_data();
  io.out = updates->typed_data();
  return ffi::Error::Success();
}

// Zeros the update rows of slots whose id names no row.
void ZeroUnnamed(const RuleIo& io) {
  for (int64_t s = 0; s < io.n; ++s) {
    if (!Named(io.ids[s], io.rows)) {
      std::memset(io.out + s * io.width, 0, io.width * sizeof(float));
    }
  }
}

// TensorFlow's Adam rule with epsilon hat, per entry of row r:
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  [vmax = max(vmax, v)]
//   update = corr * m / (sqrt(v' + eps_root) + eps),  v' = vmax or v,
// with corr = sqrt(1 - b2^t) / (1 - b1^t) computed by the caller.
// hyper = (b1, 1 - b1, b2, 1 - b2, eps, eps_root, corr).
struct AdamHyper {
  float b1, c1, b2, c2, eps, eps_root, corr;
};

template <typename SM, typename SV, bool kAms>
__attribute__((always_inline)) inline void AdamRow(
    const AdamHyper& a, typename SM::T* __restrict__ m,
    typename SV::T* __restrict__ v, typename SV::T* __restrict__ x,
    const float* __restrict__ g, float* __restrict__ u, int64_t w) {
  for (int64_t k = 0; k < w; ++k) {
    const float gk = g[k];
    // The step reads the moments as stored (rounded to their dtype), as the
    // XLA rule does.
    const float mk = SM::Rounded(a.b1 * SM::Load(m + k) + a.c1 * gk);
    float vk = SV::Rounded(a.b2 * SV::Load(v + k) + a.c2 * (gk * gk));
    SM::Store(m + k, mk);
    SV::Store(v + k, vk);
    if constexpr (kAms) {
      vk = std::max(SV::Load(x + k), vk);
      SV::Store(x + k, vk);
    }
    u[k] = a.corr * mk / (std::sqrt(vk + a.eps_root) + a.eps);
  }
}

template <typename SM, typename SV, bool kAms>
void AdamRows(ffi::ThreadPool& pool, const RuleIo& io, const float* h,
              typename SM::T* mu, typename SV::T* nu, typename SV::T* vmax) {
  const AdamHyper a{h[0], h[1], h[2], h[3], h[4], h[5], h[6]};
  const int64_t w = io.width;
  ParallelFor(pool, io.n, w, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      if (s + kPrefetchAhead < end && Named(io.ids[s + kPrefetchAhead], io.rows)) {
        const int64_t p = io.ids[s + kPrefetchAhead];
        Prefetch(mu, p, w * sizeof(typename SM::T), true);
        Prefetch(nu, p, w * sizeof(typename SV::T), true);
        if (kAms) Prefetch(vmax, p, w * sizeof(typename SV::T), true);
      }
      const int64_t r = io.ids[s];
      if (!Named(io.ids[s], io.rows)) continue;
      AdamRow<SM, SV, kAms>(a, mu + r * w, nu + r * w,
                            kAms ? vmax + r * w : nullptr, io.g + s * w,
                            io.out + s * w, w);
    }
  });
  ZeroUnnamed(io);
}

template <bool kAms>
ffi::Error AdamImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> ids,
                    ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> hyper,
                    ffi::AnyBuffer mu_in, ffi::AnyBuffer nu_in,
                    const ffi::AnyBuffer* vmax_in,
                    ffi::Result<ffi::AnyBuffer>& mu_out,
                    ffi::Result<ffi::AnyBuffer>& nu_out,
                    ffi::Result<ffi::AnyBuffer>* vmax_out,
                    ffi::Result<ffi::Buffer<ffi::F32>>& updates) {
  RuleIo io;
  const Shape2 t = AsRows(mu_in.dimensions());
  if (auto e = CheckRule("LazyOptaxAdam", ids, g, updates, io, t.rows);
      e.failure()) {
    return e;
  }
  if (t.width != io.width || nu_in.element_count() != mu_in.element_count() ||
      hyper.element_count() != 7 ||
      (kAms && (vmax_in->element_count() != nu_in.element_count() ||
                vmax_in->element_type() != nu_in.element_type()))) {
    return ffi::Error::InvalidArgument("LazyOptaxAdam: operand shapes");
  }
  void* mu = InPlace(mu_in, mu_out);
  void* nu = InPlace(nu_in, nu_out);
  void* vmax = kAms ? InPlace(*vmax_in, *vmax_out) : nullptr;
  const float* h = hyper.typed_data();
  return WithStorage(mu_in.element_type(), [&](auto sm) {
    using SM = decltype(sm);
    return WithStorage(nu_in.element_type(), [&](auto sv) {
      using SV = decltype(sv);
      AdamRows<SM, SV, kAms>(pool, io, h, static_cast<typename SM::T*>(mu),
                             static_cast<typename SV::T*>(nu),
                             static_cast<typename SV::T*>(vmax));
      return ffi::Error::Success();
    });
  });
}

ffi::Error Adam(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> ids,
                ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> hyper,
                ffi::AnyBuffer mu, ffi::AnyBuffer nu,
                ffi::Result<ffi::AnyBuffer> mu_out,
                ffi::Result<ffi::AnyBuffer> nu_out,
                ffi::Result<ffi::Buffer<ffi::F32>> updates) {
  return AdamImpl<false>(pool, ids, g, hyper, mu, nu, nullptr, mu_out, nu_out,
                         nullptr, updates);
}

ffi::Error Amsgrad(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> ids,
                   ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> hyper,
                   ffi::AnyBuffer mu, ffi::AnyBuffer nu, ffi::AnyBuffer vmax,
                   ffi::Result<ffi::AnyBuffer> mu_out,
                   ffi::Result<ffi::AnyBuffer> nu_out,
                   ffi::Result<ffi::AnyBuffer> vmax_out,
                   ffi::Result<ffi::Buffer<ffi::F32>> updates) {
  return AdamImpl<true>(pool, ids, g, hyper, mu, nu, &vmax, mu_out, nu_out,
                        &vmax_out, updates);
}

// Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD), per row r:
//   g' = g + l2 * p_r                   (FBGEMM's L2 mode; l2 = 0 otherwise)
//   G_r = G_r + mean(g'^2);  update = g' / (sqrt(G_r) + eps)
// hyper = (eps, l2); `params` holds the parameter rows of the slots (read
// only when l2 is not zero).
// The sum of x[k]^2 over a row, in 8 running sums (so that it vectorizes).
inline float SumOfSquares(const float* __restrict__ x, int64_t w) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= w; k += 8) {
    for (int j = 0; j < 8; ++j) part[j] += x[k + j] * x[k + j];
  }
  float sum = 0.0f;
  for (; k < w; ++k) sum += x[k] * x[k];
  for (int j = 0; j < 8; ++j) sum += part[j];
  return sum;
}

template <typename SA>
void RowwiseAdagradRows(ffi::ThreadPool& pool, const RuleIo& io,
                        const float* h, const float* params,
                        typename SA::T* acc) {
  const float eps = h[0], l2 = h[1];
  const int64_t w = io.width;
  const float inv_w = 1.0f / static_cast<float>(w);
  ParallelFor(pool, io.n, w, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      if (s + kPrefetchAhead < end && Named(io.ids[s + kPrefetchAhead], io.rows)) {
        __builtin_prefetch(acc + io.ids[s + kPrefetchAhead], 1);
      }
      const int32_t r = io.ids[s];
      if (!Named(r, io.rows)) continue;
      const float* __restrict__ gs = io.g + s * w;
      float* __restrict__ u = io.out + s * w;
      const float* g = gs;
      if (l2 != 0.0f) {  // FBGEMM's L2 mode: the decay joins the gradient
        const float* __restrict__ ps = params + s * w;
        for (int64_t k = 0; k < w; ++k) u[k] = gs[k] + l2 * ps[k];
        g = u;
      }
      const float a =
          SA::Rounded(SA::Load(acc + r) + SumOfSquares(g, w) * inv_w);
      SA::Store(acc + r, a);
      const float denom = std::sqrt(a) + eps;
      for (int64_t k = 0; k < w; ++k) u[k] = g[k] / denom;
    }
  });
  ZeroUnnamed(io);
}

ffi::Error RowwiseAdagrad(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> ids,
                          ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> hyper,
                          ffi::Buffer<ffi::F32> params, ffi::AnyBuffer acc_in,
                          ffi::Result<ffi::AnyBuffer> acc_out,
                          ffi::Result<ffi::Buffer<ffi::F32>> updates) {
  RuleIo io;
  const Shape2 a = AsRows(acc_in.dimensions());
  if (auto e = CheckRule("LazyOptaxRowwiseAdagrad", ids, g, updates, io,
                         a.rows);
      e.failure()) {
    return e;
  }
  if (a.width != 1 || hyper.element_count() != 2 ||
      params.element_count() != g.element_count()) {
    return ffi::Error::InvalidArgument(
        "LazyOptaxRowwiseAdagrad: operand shapes");
  }
  void* acc = InPlace(acc_in, acc_out);
  return WithStorage(acc_in.element_type(), [&](auto sa) {
    using SA = decltype(sa);
    RowwiseAdagradRows<SA>(pool, io, hyper.typed_data(), params.typed_data(),
                           static_cast<typename SA::T*>(acc));
    return ffi::Error::Success();
  });
}

// Partial row-wise Adam (FBGEMM's PARTIAL_ROWWISE_ADAM), per row r:
//   m = b1 m + (1 - b1) g                 (per entry)
//   v_r = b2 v_r + (1 - b2) mean(g^2)     (per row)
//   update = (m / bc1) / (sqrt(v_r / bc2 + eps_root) + eps)
// hyper = (b1, 1 - b1, b2, 1 - b2, eps, eps_root, bc1, bc2), bc = 1 - b^t.
template <typename SM, typename SV>
void PartialRowwiseAdamRows(ffi::ThreadPool& pool, const RuleIo& io,
                            const float* h, typename SM::T* mu,
                            typename SV::T* nu) {
  const float b1 = h[0], c1 = h[1], b2 = h[2], c2 = h[3], eps = h[4];
  const float eps_root = h[5], bc1 = h[6], bc2 = h[7];
  const int64_t w = io.width;
  const float inv_w = 1.0f / static_cast<float>(w);
  ParallelFor(pool, io.n, w, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      if (s + kPrefetchAhead < end && Named(io.ids[s + kPrefetchAhead], io.rows)) {
        Prefetch(mu, io.ids[s + kPrefetchAhead], w * sizeof(typename SM::T),
                 true);
      }
      const int32_t r = io.ids[s];
      if (!Named(r, io.rows)) continue;
      typename SM::T* __restrict__ m = mu + static_cast<int64_t>(r) * w;
      const float* __restrict__ gs = io.g + s * w;
      float* __restrict__ u = io.out + s * w;
      const float v = SV::Rounded(b2 * SV::Load(nu + r) +
                                  c2 * (SumOfSquares(gs, w) * inv_w));
      SV::Store(nu + r, v);
      const float denom = std::sqrt(v / bc2 + eps_root) + eps;
      for (int64_t k = 0; k < w; ++k) {
        const float mk = SM::Rounded(b1 * SM::Load(m + k) + c1 * gs[k]);
        SM::Store(m + k, mk);
        u[k] = (mk / bc1) / denom;
      }
    }
  });
  ZeroUnnamed(io);
}

ffi::Error PartialRowwiseAdam(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> ids,
                              ffi::Buffer<ffi::F32> g,
                              ffi::Buffer<ffi::F32> hyper, ffi::AnyBuffer mu_in,
                              ffi::AnyBuffer nu_in,
                              ffi::Result<ffi::AnyBuffer> mu_out,
                              ffi::Result<ffi::AnyBuffer> nu_out,
                              ffi::Result<ffi::Buffer<ffi::F32>> updates) {
  RuleIo io;
  const Shape2 t = AsRows(mu_in.dimensions());
  if (auto e = CheckRule("LazyOptaxPartialRowwiseAdam", ids, g, updates, io,
                         t.rows);
      e.failure()) {
    return e;
  }
  const Shape2 v = AsRows(nu_in.dimensions());
  if (t.width != io.width || v.rows != t.rows || v.width != 1 ||
      hyper.element_count() != 8) {
    return ffi::Error::InvalidArgument(
        "LazyOptaxPartialRowwiseAdam: operand shapes");
  }
  void* mu = InPlace(mu_in, mu_out);
  void* nu = InPlace(nu_in, nu_out);
  const float* h = hyper.typed_data();
  return WithStorage(mu_in.element_type(), [&](auto sm) {
    using SM = decltype(sm);
    return WithStorage(nu_in.element_type(), [&](auto sv) {
      using SV = decltype(sv);
      PartialRowwiseAdamRows<SM, SV>(pool, io, h,
                                     static_cast<typename SM::T*>(mu),
                                     static_cast<typename SV::T*>(nu));
      return ffi::Error::Success();
    });
  });
}

// FTRL-Proximal (TensorFlow's ApplyFtrlV2), per entry, with pw = -lr_power:
//   gs = g + 2 l2_shrinkage w;  n' = n + g^2;  sigma = (n'^pw - n^pw) / lr
//   z = z + gs - sigma w;  q = (beta + n'^pw) / lr + 2 l2
//   w' = (sign(z) l1 - z) / q if |z| > l1 else 0;  update = w' - w
// hyper = (lr, pw, l1, l2, l2_shrinkage, beta); `params` holds the slots'
// parameter rows.
inline float Power(float x, float pw) {
  if (pw == 0.5f) return std::sqrt(x);
  if (pw == 0.0f) return 1.0f;
  return std::pow(x, pw);
}

template <typename SN, typename SZ>
void FtrlRows(ffi::ThreadPool& pool, const RuleIo& io, const float* h,
              const float* params, typename SN::T* acc, typename SZ::T* lin) {
  const float lr = h[0], pw = h[1], l1 = h[2], l2 = h[3], shrink = h[4];
  const float beta = h[5];
  const int64_t w = io.width;
  ParallelFor(pool, io.n, w, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      if (s + kPrefetchAhead < end && Named(io.ids[s + kPrefetchAhead], io.rows)) {
        const int64_t a = io.ids[s + kPrefetchAhead];
        Prefetch(acc, a, w * sizeof(typename SN::T), true);
        Prefetch(lin, a, w * sizeof(typename SZ::T), true);
      }
      const int32_t r = io.ids[s];
      if (!Named(r, io.rows)) continue;
      typename SN::T* __restrict__ n = acc + static_cast<int64_t>(r) * w;
      typename SZ::T* __restrict__ z = lin + static_cast<int64_t>(r) * w;
      const float* __restrict__ gs = io.g + s * w;
      const float* __restrict__ ws = params + s * w;
      float* __restrict__ u = io.out + s * w;
      for (int64_t k = 0; k < w; ++k) {
        const float gk = gs[k], wk = ws[k];
        const float nk = SN::Load(n + k);
        const float n_new = nk + gk * gk;
        const float n_pow = Power(n_new, pw);
        const float sigma = (n_pow - Power(nk, pw)) / lr;
        const float zk = SZ::Rounded(SZ::Load(z + k) +
                                     (gk + 2.0f * shrink * wk) - sigma * wk);
        SN::Store(n + k, n_new);
        SZ::Store(z + k, zk);
        // The step reads the new state as stored, as the XLA rule does.
        const float n_pow_s = std::is_same_v<SN, F32>
                                  ? n_pow
                                  : Power(SN::Rounded(n_new), pw);
        float q = (beta + n_pow_s) / lr + 2.0f * l2;
        if (!(q > 0.0f)) q = 1.0f;
        const float w_new =
            std::fabs(zk) > l1 ? (std::copysign(l1, zk) - zk) / q : 0.0f;
        u[k] = w_new - wk;
      }
    }
  });
  ZeroUnnamed(io);
}

ffi::Error Ftrl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> ids,
                ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> hyper,
                ffi::Buffer<ffi::F32> params, ffi::AnyBuffer n_in,
                ffi::AnyBuffer z_in, ffi::Result<ffi::AnyBuffer> n_out,
                ffi::Result<ffi::AnyBuffer> z_out,
                ffi::Result<ffi::Buffer<ffi::F32>> updates) {
  RuleIo io;
  const Shape2 t = AsRows(n_in.dimensions());
  if (auto e = CheckRule("LazyOptaxFtrl", ids, g, updates, io, t.rows);
      e.failure()) {
    return e;
  }
  if (t.width != io.width || z_in.element_count() != n_in.element_count() ||
      hyper.element_count() != 6 ||
      params.element_count() != g.element_count()) {
    return ffi::Error::InvalidArgument("LazyOptaxFtrl: operand shapes");
  }
  void* n = InPlace(n_in, n_out);
  void* z = InPlace(z_in, z_out);
  const float* h = hyper.typed_data();
  return WithStorage(n_in.element_type(), [&](auto sn) {
    using SN = decltype(sn);
    return WithStorage(z_in.element_type(), [&](auto sz) {
      using SZ = decltype(sz);
      FtrlRows<SN, SZ>(pool, io, h, params.typed_data(),
                       static_cast<typename SN::T*>(n),
                       static_cast<typename SZ::T*>(z));
      return ffi::Error::Success();
    });
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxDedup, Dedup,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("num_rows"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxAfter, After,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxGather, Gather,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxScatter, Scatter,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxScatterAdd, ScatterAdd,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxAddStochastic, AddStochastic,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxAdam, Adam,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxAmsgrad, Amsgrad,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxRowwiseAdagrad, RowwiseAdagrad,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxPartialRowwiseAdam, PartialRowwiseAdam,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxFtrl, Ftrl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

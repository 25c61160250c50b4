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
// Storage dtypes: float32 and bfloat16 for tables and moments, int32 for a
// rule's per-row counters (exact at any dtype of the table); gradients and
// updates are float32 (the caller casts). Arithmetic is float32, rounded to
// the storage dtype to nearest even, as XLA's convert does.
//
// Handlers (Python wrappers in __init__.py say what each returns):
//   LazyOptaxDedup          distinct ids (ascending) and summed rows
//   LazyOptaxGather         table[ids]
//   LazyOptaxScatter        table[ids] = rows           (in place)
//   LazyOptaxAdam           TensorFlow's Adam rule (epsilon hat)
//   LazyOptaxAmsgrad        the same with the running maximum of nu
//   LazyOptaxRowwiseAdagrad one accumulator per row (FBGEMM's rule)
//   LazyOptaxPartialRowwiseAdam  mu per entry, nu per row (FBGEMM's rule)
//   LazyOptaxFtrl           FTRL-Proximal (TensorFlow's ApplyFtrlV2)
//   LazyOptaxRowwiseRmspropAr  row-wise RMSprop with adaptive regularization
//                           (FBGEMM's ROWWISE_RMSPROP_AR)
//   LazyOptaxRowwiseAdagradWithCounter  row-wise Adagrad with per-row counters
//                           (FBGEMM's COUNTER weight-decay mode, AdagradW)

#include <algorithm>
#include <array>
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

// The tuning constants below were measured on CPU only (2-core x86-64 VMs,
// 1 and 2 threads; these kernels run on no other platform): see
// docs/design.md, "Constants measured on CPU only".
// Rows prefetched ahead in the row loops: 4, 16, 24, 32 and 64 measured no
// better than 8 (benchmarks/HISTORY.md).
constexpr int64_t kPrefetchAhead = 8;
// Row loops are split into chunks of kChunkRows slots, shared out over XLA's
// intra-op thread pool when it has several threads and the call touches at
// least kParallelMinValues values. Measured on CPU only, as a pair (sharing
// the rule's rows over 2 threads: 1,000,000 x 64 `lazy_adam` 1.27 -> 1.03
// ms); the two values were not swept.
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

// int32 storage, for per-row counters: read and written as integers (see
// Row<I32>), never through float32.
struct I32 {
  using T = int32_t;
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
  // The radix digit: the sort was measured on CPU only; 11 was not swept.
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
// Row movement: gather and scatter (set).

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

// ---------------------------------------------------------------------------
// Rule kernels: one row loop (RuleKernel) and, per rule, its arithmetic.
//
// Every rule kernel has the same operands: the ids [N] (int32, distinct),
// the gradient rows `g` [N, W] (float32), the hyperparameter record (float32
// values, the fields of the rule's `Hyper`), the parameter rows [N, W]
// (float32; rules that read none get `g` again) and its state tables, each
// `[R, W]` (a value per entry) or `[R]` (one per row). It updates the tables
// in place at the ids' rows and returns them, after the update rows [N, W]
// (float32; zeros where the id names no row).
//
// A rule is a struct with
//   Hyper        its hyperparameter record, declared with LAZY_OPTAX_HYPER
//                (the field names are exported, and Python's record must
//                list the same ones in the same order);
//   kPerRow      one bool per state table: one value per row (else per
//                entry), in the order Python passes the tables;
//   kInt32       (optional) one bool per state table: an int32 table (a
//                counter, `Row<I32>`: exact integers), else float32 or
//                bfloat16;
//   Row(h, io, tables...)  the arithmetic of one row: `io` holds the row's
//                gradient, parameters and update; each table is a `Row<S>`
//                whose `t[k]` reads entry k in float32 and `t.Put(k, x)`
//                stores x rounded to the table's dtype and returns the value
//                as stored (what the XLA rule's step reads).
// The loop (RuleRows) does the rest: operand checks, dtype dispatch,
// prefetching, the threads, in-place aliasing and the unnamed slots.

// A hyperparameter record: `LAZY_OPTAX_HYPER(FIELDS)` inside a rule, with
// FIELDS an X-macro `#define FIELDS(F) F(b1) F(b2) ...`, declares
// `struct Hyper { float b1; float b2; ... }` and `kFields`, its field names
// separated by commas (exported for the Python side's check). An int32 field
// (the global step, exact past 2^24) is `LAZY_OPTAX_INT(F, step)` in FIELDS;
// its exported name is `step:int32`, and Python packs its bits unchanged.
#define LAZY_OPTAX_HYPER_FIELD(name) float name;
#define LAZY_OPTAX_HYPER_NAME(name) #name ","
#define LAZY_OPTAX_HYPER_FIELD_INT(name) int32_t name;
#define LAZY_OPTAX_HYPER_NAME_INT(name) #name ":int32,"
#define LAZY_OPTAX_INT(F, name) F##_INT(name)
#define LAZY_OPTAX_HYPER(FIELDS)                        \
  struct Hyper {                                        \
    FIELDS(LAZY_OPTAX_HYPER_FIELD)                      \
  };                                                    \
  static constexpr const char* kFields = FIELDS(LAZY_OPTAX_HYPER_NAME);

// One row of a state table, in its storage dtype S.
template <typename S>
struct Row {
  typename S::T* __restrict__ p;
  float operator[](int64_t k) const { return S::Load(p + k); }
  float Put(int64_t k, float x) const {
    const float stored = S::Rounded(x);
    S::Store(p + k, stored);
    return stored;
  }
};

// A row of an int32 table (a counter): integers in, integers out.
template <>
struct Row<I32> {
  int32_t* __restrict__ p;
  int32_t operator[](int64_t k) const { return p[k]; }
  int32_t Put(int64_t k, int32_t x) const {
    p[k] = x;
    return x;
  }
};

// Whether a rule's table i is int32: `kInt32[i]` where the rule declares
// `kInt32` (one bool per table, as kPerRow), else false.
template <typename Rule, typename = void>
struct Int32Tables {
  static constexpr bool At(size_t) { return false; }
};
template <typename Rule>
struct Int32Tables<Rule, std::void_t<decltype(Rule::kInt32)>> {
  static_assert(sizeof(Rule::kInt32) == sizeof(Rule::kPerRow),
                "kInt32 and kPerRow list the same tables");
  static constexpr bool At(size_t i) { return Rule::kInt32[i]; }
};

// The slot's own rows: gradient, parameters (or the gradient) and update,
// their width and its inverse (for means over a row).
struct RowIo {
  const float* __restrict__ g;
  const float* __restrict__ p;
  float* __restrict__ u;
  int64_t w;
  float inv_w;
};

// The sum of x(k)^2 over a row, in 8 running sums (so that it vectorizes).
template <typename X>
__attribute__((always_inline)) inline float SumOfSquaresOf(X x, int64_t w) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= w; k += 8) {
    for (int j = 0; j < 8; ++j) {
      const float v = x(k + j);
      part[j] += v * v;
    }
  }
  float sum = 0.0f;
  for (; k < w; ++k) {
    const float v = x(k);
    sum += v * v;
  }
  for (int j = 0; j < 8; ++j) sum += part[j];
  return sum;
}

inline float SumOfSquares(const float* __restrict__ x, int64_t w) {
  return SumOfSquaresOf([x](int64_t k) { return x[k]; }, w);
}

template <typename Rule, typename... S, size_t... I>
void RuleRows(ffi::ThreadPool& pool, const int32_t* ids, int64_t n,
              int64_t rows, int64_t w, const typename Rule::Hyper& h,
              const float* g, const float* params, float* out,
              std::index_sequence<I...>, typename S::T*... tables) {
  // Values per table row: one (per row) or w (per entry).
  const std::array<int64_t, sizeof...(I)> width = {
      (Rule::kPerRow[I] ? int64_t{1} : w)...};
  const float inv_w = 1.0f / static_cast<float>(w);
  ParallelFor(pool, n, w, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      if (s + kPrefetchAhead < end && Named(ids[s + kPrefetchAhead], rows)) {
        const int64_t a = ids[s + kPrefetchAhead];
        (Prefetch(tables, a,
                  width[I] * static_cast<int64_t>(sizeof(typename S::T)), true),
         ...);
      }
      const int64_t r = ids[s];
      if (!Named(ids[s], rows)) continue;
      Rule::Row(h,
                RowIo{g + s * w, params + s * w, out + s * w, w, inv_w},
                Row<S>{tables + r * width[I]}...);
    }
  });
  for (int64_t s = 0; s < n; ++s) {  // slots whose id names no row
    if (Named(ids[s], rows)) continue;
    std::memset(out + s * w, 0, w * sizeof(float));
  }
}

// Calls fn(S...) with the storage of each of the N `types`: I32 for the
// rule's int32 tables, F32 or BF16 for the others.
template <typename Rule, size_t N, typename Fn, typename... S>
ffi::Error WithStorages(const char* name, const ffi::DataType* types, Fn& fn,
                        S... s) {
  constexpr size_t i = sizeof...(S);
  if constexpr (i == N) {
    return fn(s...);
  } else if constexpr (Int32Tables<Rule>::At(i)) {
    if (types[i] != ffi::DataType::S32) {
      return ffi::Error::InvalidArgument(
          std::string(name) + ": state table " + std::to_string(i) +
          " must be int32 (a per-row counter)");
    }
    return WithStorages<Rule, N>(name, types, fn, s..., I32{});
  } else {
    return WithStorage(types[i], [&](auto t) {
      return WithStorages<Rule, N>(name, types, fn, s..., t);
    });
  }
}

template <typename Rule, size_t... I>
ffi::Error RunRule(const char* name, ffi::ThreadPool& pool,
                   ffi::Buffer<ffi::S32>& ids, ffi::Buffer<ffi::F32>& g,
                   ffi::Buffer<ffi::U32>& hyper,
                   ffi::Buffer<ffi::F32>& params,
                   ffi::RemainingArgs& ins,
                   ffi::Result<ffi::Buffer<ffi::F32>>& updates,
                   ffi::RemainingRets& outs, std::index_sequence<I...> seq) {
  constexpr size_t kTables = sizeof...(I);
  auto fail = [name](const char* what) {
    return ffi::Error::InvalidArgument(std::string(name) + ": " + what);
  };
  const Shape2 gs = AsRows(g.dimensions());
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (gs.rows != n || updates->element_count() != g.element_count() ||
      params.element_count() != g.element_count()) {
    return fail("gradient, parameter and update shapes");
  }
  if (hyper.element_count() * sizeof(uint32_t) !=
      sizeof(typename Rule::Hyper)) {
    return fail("hyperparameters (not the fields of its record)");
  }
  typename Rule::Hyper h;
  std::memcpy(&h, hyper.typed_data(), sizeof(h));
  if (ins.size() != kTables || outs.size() != kTables) {
    return fail("state tables (a wrong count)");
  }
  std::array<ffi::DataType, kTables> types{};
  std::array<void*, kTables> data{};
  int64_t rows = -1;
  for (size_t i = 0; i < kTables; ++i) {
    auto in = ins.get<ffi::AnyBuffer>(i);
    auto out = outs.get<ffi::AnyBuffer>(i);
    if (!in.has_value() || !out.has_value()) return fail("state tables");
    const Shape2 t = AsRows(in->dimensions());
    if (rows < 0) rows = t.rows;
    if (t.rows != rows ||
        t.width != (Rule::kPerRow[i] ? int64_t{1} : gs.width) ||
        (*out)->element_type() != in->element_type()) {
      return fail("state table shapes");
    }
    types[i] = in->element_type();
    data[i] = InPlace(*in, *out);
  }
  auto run = [&](auto... s) {
    RuleRows<Rule, decltype(s)...>(
        pool, ids.typed_data(), n, rows, gs.width, h, g.typed_data(),
        params.typed_data(), updates->typed_data(), seq,
        static_cast<typename decltype(s)::T*>(data[I])...);
    return ffi::Error::Success();
  };
  return WithStorages<Rule, kTables>(name, types.data(), run);
}

// The FFI handler of `Rule` (see LAZY_OPTAX_RULE).
template <typename Rule>
struct RuleKernel {
  static ffi::Error Call(const char* name, ffi::ThreadPool pool,
                         ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> g,
                         ffi::Buffer<ffi::U32> hyper,
                         ffi::Buffer<ffi::F32> params, ffi::RemainingArgs ins,
                         ffi::Result<ffi::Buffer<ffi::F32>> updates,
                         ffi::RemainingRets outs) {
    constexpr size_t kTables = sizeof(Rule::kPerRow) / sizeof(bool);
    return RunRule<Rule>(name, pool, ids, g, hyper, params, ins, updates,
                         outs, std::make_index_sequence<kTables>());
  }
};

// TensorFlow's Adam rule with epsilon hat, per entry:
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  [vmax = max(vmax, v)]
//   update = correction * m / (sqrt(v' + eps_root) + eps),  v' = vmax or v,
// correction = sqrt(1 - b2^t) / (1 - b1^t) computed by the caller.
#define ADAM_FIELDS(F) \
  F(b1) F(one_minus_b1) F(b2) F(one_minus_b2) F(eps) F(eps_root) F(correction)

struct AdamRule {
  LAZY_OPTAX_HYPER(ADAM_FIELDS)
  static constexpr bool kPerRow[] = {false, false};  // mu, nu
  template <typename M, typename V>
  __attribute__((always_inline)) static void Row(const Hyper& a,
                                                 const RowIo& io, M m, V v) {
    for (int64_t k = 0; k < io.w; ++k) {
      const float gk = io.g[k];
      const float mk = m.Put(k, a.b1 * m[k] + a.one_minus_b1 * gk);
      const float vk = v.Put(k, a.b2 * v[k] + a.one_minus_b2 * (gk * gk));
      io.u[k] = a.correction * mk / (std::sqrt(vk + a.eps_root) + a.eps);
    }
  }
};

struct AmsgradRule {
  LAZY_OPTAX_HYPER(ADAM_FIELDS)
  static constexpr bool kPerRow[] = {false, false, false};  // mu, nu, nu_max
  template <typename M, typename V, typename X>
  __attribute__((always_inline)) static void Row(const Hyper& a,
                                                 const RowIo& io, M m, V v,
                                                 X x) {
    for (int64_t k = 0; k < io.w; ++k) {
      const float gk = io.g[k];
      const float mk = m.Put(k, a.b1 * m[k] + a.one_minus_b1 * gk);
      const float vk = v.Put(k, a.b2 * v[k] + a.one_minus_b2 * (gk * gk));
      const float xk = x.Put(k, std::max(x[k], vk));
      io.u[k] = a.correction * mk / (std::sqrt(xk + a.eps_root) + a.eps);
    }
  }
};

// Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD), per row:
//   g' = g + l2 p                       (FBGEMM's L2 mode; l2 = 0 otherwise)
//   G = G + mean(g'^2);  update = g' / (sqrt(G) + eps)
#define ROWWISE_ADAGRAD_FIELDS(F) F(eps) F(l2)

struct RowwiseAdagradRule {
  LAZY_OPTAX_HYPER(ROWWISE_ADAGRAD_FIELDS)
  static constexpr bool kPerRow[] = {true};  // sum_of_squares
  template <typename A>
  __attribute__((always_inline)) static void Row(const Hyper& h,
                                                 const RowIo& io, A acc) {
    const int64_t w = io.w;
    const float* g = io.g;
    if (h.l2 != 0.0f) {  // the decay joins the gradient
      for (int64_t k = 0; k < w; ++k) io.u[k] = io.g[k] + h.l2 * io.p[k];
      g = io.u;
    }
    const float a = acc.Put(0, acc[0] + SumOfSquares(g, w) * io.inv_w);
    const float denom = std::sqrt(a) + h.eps;
    for (int64_t k = 0; k < w; ++k) io.u[k] = g[k] / denom;
  }
};

// Partial row-wise Adam (FBGEMM's PARTIAL_ROWWISE_ADAM), per row:
//   m = b1 m + (1 - b1) g                 (per entry)
//   v = b2 v + (1 - b2) mean(g^2)         (per row)
//   update = (m / bc1) / (sqrt(v / bc2 + eps_root) + eps),  bc = 1 - b^t.
#define PARTIAL_ROWWISE_ADAM_FIELDS(F)                                    \
  F(b1) F(one_minus_b1) F(b2) F(one_minus_b2) F(eps) F(eps_root)         \
  F(bias_correction1) F(bias_correction2)

struct PartialRowwiseAdamRule {
  LAZY_OPTAX_HYPER(PARTIAL_ROWWISE_ADAM_FIELDS)
  static constexpr bool kPerRow[] = {false, true};  // mu, nu
  template <typename M, typename V>
  __attribute__((always_inline)) static void Row(const Hyper& h,
                                                 const RowIo& io, M m, V nu) {
    const int64_t w = io.w;
    const float v = nu.Put(
        0, h.b2 * nu[0] + h.one_minus_b2 * (SumOfSquares(io.g, w) * io.inv_w));
    const float denom = std::sqrt(v / h.bias_correction2 + h.eps_root) + h.eps;
    for (int64_t k = 0; k < w; ++k) {
      const float mk = m.Put(k, h.b1 * m[k] + h.one_minus_b1 * io.g[k]);
      io.u[k] = (mk / h.bias_correction1) / denom;
    }
  }
};

// FTRL-Proximal (TensorFlow's ApplyFtrlV2), per entry, with pw = -lr_power:
//   gs = g + 2 l2_shrinkage w;  n' = n + g^2;  sigma = (n'^pw - n^pw) / lr
//   z = z + gs - sigma w;  q = (beta + n'^pw) / lr + 2 l2
//   w' = (sign(z) l1 - z) / q if |z| > l1 else 0;  update = w' - w
inline float Power(float x, float pw) {
  if (pw == 0.5f) return std::sqrt(x);
  if (pw == 0.0f) return 1.0f;
  return std::pow(x, pw);
}

#define FTRL_FIELDS(F) F(lr) F(power) F(l1) F(l2) F(l2_shrinkage) F(beta)

struct FtrlRule {
  LAZY_OPTAX_HYPER(FTRL_FIELDS)
  static constexpr bool kPerRow[] = {false, false};  // accumulator, linear
  template <typename N, typename Z>
  __attribute__((always_inline)) static void Row(const Hyper& h,
                                                 const RowIo& io, N n, Z z) {
    for (int64_t k = 0; k < io.w; ++k) {
      const float gk = io.g[k], wk = io.p[k];
      const float nk = n[k];
      const float n_new = nk + gk * gk;
      const float n_pow = Power(n_new, h.power);
      const float sigma = (n_pow - Power(nk, h.power)) / h.lr;
      const float zk =
          z.Put(k, z[k] + (gk + 2.0f * h.l2_shrinkage * wk) - sigma * wk);
      // The step reads the new state as stored, as the XLA rule does.
      const float n_stored = n.Put(k, n_new);
      const float n_pow_s = n_stored == n_new ? n_pow : Power(n_stored, h.power);
      float q = (h.beta + n_pow_s) / h.lr + 2.0f * h.l2;
      if (!(q > 0.0f)) q = 1.0f;
      const float w_new =
          std::fabs(zk) > h.l1 ? (std::copysign(h.l1, zk) - zk) / q : 0.0f;
      io.u[k] = w_new - wk;
    }
  }
};

// Row-wise RMSprop with adaptive regularization (FBGEMM's
// ROWWISE_RMSPROP_AR), per row, with `step` the global step (from 1) and
// `prev` the step of the row's last update (0: never updated):
//   v = beta v + (1 - beta) mean(g^2)
//   I = step - prev (1 if prev is 0);  lambda = clip(lr ar_alpha I, 0, 1)
//   update = (max(min_shrinkage, 1 - lambda) - 1) w - lr g / (sqrt(v) + eps)
//   prev = step
#define ROWWISE_RMSPROP_AR_FIELDS(F)                                       \
  F(lr) F(ar_alpha) F(ema_beta) F(one_minus_beta) F(min_shrinkage) F(eps)  \
  LAZY_OPTAX_INT(F, step)

struct RowwiseRmspropArRule {
  LAZY_OPTAX_HYPER(ROWWISE_RMSPROP_AR_FIELDS)
  static constexpr bool kPerRow[] = {true, true};   // v, prev_iter
  static constexpr bool kInt32[] = {false, true};
  template <typename V, typename P>
  __attribute__((always_inline)) static void Row(const Hyper& h,
                                                 const RowIo& io, V v,
                                                 P prev_iter) {
    const int64_t w = io.w;
    const float vr = v.Put(
        0, h.ema_beta * v[0] + h.one_minus_beta * (SumOfSquares(io.g, w) *
                                                   io.inv_w));
    const int32_t prev = prev_iter[0];
    const int32_t gap = prev == 0 ? 1 : h.step - prev;
    const float lambda =
        std::min(std::max(h.lr * h.ar_alpha * static_cast<float>(gap), 0.0f),
                 1.0f);
    const float keep = std::max(h.min_shrinkage, 1.0f - lambda) - 1.0f;
    const float scale = h.lr / (std::sqrt(vr) + h.eps);
    for (int64_t k = 0; k < w; ++k) io.u[k] = keep * io.p[k] - scale * io.g[k];
    prev_iter.Put(0, h.step);
  }
};

// Row-wise Adagrad with per-row counters (FBGEMM's EXACT_ROWWISE_ADAGRAD
// with WeightDecayMode.COUNTER), per row, with `step` the global step (from
// 1), `prev` the step of the row's last update (0: never) and
// d = step - prev (1 if prev is 0):
//   c = 1 + exp(-d log_rho) c (halflife > 0) | 1 (halflife 0) | c + 1
//   g' = g + wd w (L2);  G += mean(g'^2);  m = lr / (sqrt(G) + eps)
//   adj = m adjusted by the learning-rate mode (c > threshold), corr the
//   decay (AdagradW: (1 - wd lr)^min(d, cap), adj times (1 - wd lr)^(.. - 1))
//   update = (corr - 1) w - adj g;  prev = step
// `enabled` (0 or 1) is FBGEMM's `iter > adjustment_iter`; the modes are
// codes: decay_mode 0 none, 1 L2, 2 decoupled, 3 AdagradW; lr_mode -1
// equal, 0 tail-id increase, 1 tail-id decrease, 2 counter SGD.
#define ROWWISE_ADAGRAD_COUNTER_FIELDS(F)                                  \
  F(lr) F(eps) F(wd) F(log_rho) F(halflife) F(enabled) F(adjustment_ub)   \
  F(max_counter) F(threshold) F(decay_mode) F(lr_mode)                    \
  LAZY_OPTAX_INT(F, step) LAZY_OPTAX_INT(F, catch_up_cap)

struct RowwiseAdagradCounterRule {
  LAZY_OPTAX_HYPER(ROWWISE_ADAGRAD_COUNTER_FIELDS)
  // sum_of_squares, row_counter, last_step
  static constexpr bool kPerRow[] = {true, true, true};
  static constexpr bool kInt32[] = {false, false, true};

  static float Counter(const Hyper& h, float c, float d) {
    if (h.halflife > 0.0f) return 1.0f + std::exp(-d * h.log_rho) * c;
    if (h.halflife == 0.0f) return 1.0f;
    return c + 1.0f;
  }

  static float LrAdjusted(const Hyper& h, float m, float c) {
    if (h.lr_mode < 0.0f || h.enabled == 0.0f || !(c > h.threshold)) return m;
    if (h.lr_mode == 0.0f)
      return m * std::min(std::max(std::pow(h.max_counter / (c + 1.0f),
                                            h.adjustment_ub), 1.0f), 10.0f);
    if (h.lr_mode == 1.0f)
      return m * std::min(std::max(std::pow((c + 1.0f) / h.max_counter,
                                            h.adjustment_ub), 0.1f), 1.0f);
    return h.lr / (std::sqrt(h.adjustment_ub * c) + h.eps);
  }

  template <typename A, typename C, typename P>
  __attribute__((always_inline)) static void Row(const Hyper& h,
                                                 const RowIo& io, A acc,
                                                 C counter, P last) {
    const int64_t w = io.w;
    const int32_t prev = last[0];
    const float d = static_cast<float>(prev == 0 ? 1 : h.step - prev);
    const float c = counter.Put(0, Counter(h, counter[0], d));
    const float* g = io.g;
    if (h.decay_mode == 1.0f) {  // L2: the decay joins the squared gradient
      for (int64_t k = 0; k < w; ++k) io.u[k] = io.g[k] + h.wd * io.p[k];
      g = io.u;
    }
    const float a = acc.Put(0, acc[0] + SumOfSquares(g, w) * io.inv_w);
    const float denom = std::sqrt(a) + h.eps;
    const float m = h.lr / denom;
    float adj = LrAdjusted(h, m, c);
    float corr = 1.0f;
    if (h.enabled != 0.0f) {
      if (h.decay_mode == 3.0f) {
        if (h.halflife == -1.0f) adj = m * std::sqrt(c);
        if (h.halflife == -2.0f)
          adj = std::min(h.lr * c, h.adjustment_ub) / denom;
        const float base = 1.0f - h.wd * h.lr;
        const float k = std::min(d, static_cast<float>(h.catch_up_cap));
        const float lazy = std::pow(base, k - 1.0f);
        adj *= lazy;
        corr = base * lazy;
      } else if (h.decay_mode == 2.0f || h.decay_mode == 1.0f) {
        const float freq = h.halflife / c;
        corr = 1.0f - freq * h.wd * (h.decay_mode == 2.0f ? h.lr : m);
      }
    }
    if (h.decay_mode == 0.0f) {  // the weights unread
      for (int64_t k = 0; k < w; ++k) io.u[k] = -adj * io.g[k];
    } else {
      const float keep = corr - 1.0f;
      for (int64_t k = 0; k < w; ++k)
        io.u[k] = -adj * io.g[k] + keep * io.p[k];
    }
    last.Put(0, h.step);
  }
};

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxDedup, Dedup,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("num_rows"));

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


// One FFI target per rule, `Symbol`, with its record's field names exported
// as `Symbol` + "Fields" (a comma-separated C string).
#define LAZY_OPTAX_RULE(Symbol, Rule)                                       \
  static ffi::Error Symbol##Impl(                                           \
      ffi::ThreadPool pool, ffi::Buffer<ffi::S32> ids,                      \
      ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::U32> hyper,                 \
      ffi::Buffer<ffi::F32> params, ffi::RemainingArgs ins,                 \
      ffi::Result<ffi::Buffer<ffi::F32>> updates, ffi::RemainingRets outs) { \
    return RuleKernel<Rule>::Call(#Symbol, pool, ids, g, hyper, params, ins, \
                                  updates, outs);                           \
  }                                                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Symbol, Symbol##Impl,                       \
                                ffi::Ffi::Bind()                            \
                                    .Ctx<ffi::ThreadPool>()                 \
                                    .Arg<ffi::Buffer<ffi::S32>>()           \
                                    .Arg<ffi::Buffer<ffi::F32>>()           \
                                    .Arg<ffi::Buffer<ffi::U32>>()           \
                                    .Arg<ffi::Buffer<ffi::F32>>()           \
                                    .RemainingArgs()                        \
                                    .Ret<ffi::Buffer<ffi::F32>>()           \
                                    .RemainingRets());                      \
  extern "C" const char* Symbol##Fields() { return Rule::kFields; }

LAZY_OPTAX_RULE(LazyOptaxAdam, AdamRule)
LAZY_OPTAX_RULE(LazyOptaxAmsgrad, AmsgradRule)
LAZY_OPTAX_RULE(LazyOptaxRowwiseAdagrad, RowwiseAdagradRule)
LAZY_OPTAX_RULE(LazyOptaxPartialRowwiseAdam, PartialRowwiseAdamRule)
LAZY_OPTAX_RULE(LazyOptaxFtrl, FtrlRule)
LAZY_OPTAX_RULE(LazyOptaxRowwiseRmspropAr, RowwiseRmspropArRule)
LAZY_OPTAX_RULE(LazyOptaxRowwiseAdagradWithCounter, RowwiseAdagradCounterRule)

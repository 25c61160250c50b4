// lazy_adam's row update on the CPU, as one XLA FFI call.
//
// For a batch of N ids with their gradient rows (D floats each):
//   1. duplicate ids are summed into one slot per distinct id (an
//      open-addressing hash table; slots in order of first appearance), ids
//      outside [0, R) are skipped;
//   2. for each distinct id r, in place in the [R, D] moment tables:
//        m = b1 * m + (1 - b1) * g
//        v = b2 * v + (1 - b2) * g * g
//      and the slot's update row is corr * m / (sqrt(v + eps_root) + eps);
//   3. unused slots get id R (touches no row) and zero updates.
// Step 2 runs on XLA's intra-op thread pool for large batches (rows are
// distinct, so the threads write disjoint rows).
// The moment tables are aliased to outputs 0 and 1: with donated state XLA
// hands the same buffers back, so only the touched rows are read or written.
// Inputs: ids s32[N], grads f32[N, D], hyper f32[7] = (b1, 1 - b1, b2,
// 1 - b2, eps, eps_root, corr) (1 - b computed by the caller, in double
// precision where b is a Python float, as XLA's path does), mu f32[R, D], nu f32[R, D]. Outputs: mu, nu, unique ids s32[N],
// updates f32[N, D].

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPrefetchAhead = 8;
// Step 2 is split into chunks of rows shared out over XLA's intra-op thread
// pool when it has more than one thread and the batch has at least
// kParallelMinValues values.
constexpr int64_t kChunkRows = 128;
constexpr int64_t kParallelMinValues = 1 << 16;

struct Moments {
  float b1, c1, b2, c2, eps, eps_root, corr;
  float* mu;
  float* nu;
  const int32_t* ids;
  float* out;
  int64_t d;
};

// Rows [begin, end) of step 2.
void UpdateRows(const Moments& a, int64_t begin, int64_t end) {
  const int64_t d = a.d;
  for (int64_t s = begin; s < end; ++s) {
    if (s + kPrefetchAhead < end) {
      const int64_t ahead = a.ids[s + kPrefetchAhead];
      for (int64_t k = 0; k < d; k += 16) {
        __builtin_prefetch(a.mu + ahead * d + k, 1);
        __builtin_prefetch(a.nu + ahead * d + k, 1);
      }
    }
    float* m = a.mu + static_cast<int64_t>(a.ids[s]) * d;
    float* v = a.nu + static_cast<int64_t>(a.ids[s]) * d;
    float* u = a.out + s * d;
    for (int64_t k = 0; k < d; ++k) {
      const float gk = u[k];
      const float mk = a.b1 * m[k] + a.c1 * gk;
      const float vk = a.b2 * v[k] + a.c2 * (gk * gk);
      m[k] = mk;
      v[k] = vk;
      u[k] = a.corr * mk / (std::sqrt(vk + a.eps_root) + a.eps);
    }
  }
}

// Chunks are claimed from a shared counter by the caller and by any helper
// task that starts in time; the caller waits only for chunks already
// claimed (being worked on), never for a task that has not started, so a
// busy pool cannot deadlock it. Late helpers find no chunk and return; the
// shared state lives as long as the last of them.
struct Chunks {
  Moments args;
  int64_t rows = 0;
  int64_t count = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= count) return;
      UpdateRows(args, c * kChunkRows, std::min(rows, (c + 1) * kChunkRows));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

inline uint32_t Bucket(int32_t id, int shift) {
  return (static_cast<uint32_t>(id) * 0x9E3779B1u) >> shift;
}

ffi::Error AdamRows(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> grads,
                    ffi::Buffer<ffi::F32> hyper, ffi::Buffer<ffi::F32> mu_in,
                    ffi::Buffer<ffi::F32> nu_in,
                    ffi::ResultBuffer<ffi::F32> mu_out,
                    ffi::ResultBuffer<ffi::F32> nu_out,
                    ffi::ResultBuffer<ffi::S32> unique_ids,
                    ffi::ResultBuffer<ffi::F32> updates) {
  const auto table_dims = mu_in.dimensions();
  if (table_dims.size() != 2 || grads.dimensions().size() != 2 ||
      hyper.element_count() != 7) {
    return ffi::Error::InvalidArgument("adam_rows: bad operand ranks");
  }
  const int64_t rows = table_dims[0];
  const int64_t d = table_dims[1];
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (grads.dimensions()[0] != n || grads.dimensions()[1] != d ||
      nu_in.element_count() != mu_in.element_count()) {
    return ffi::Error::InvalidArgument("adam_rows: operand shapes disagree");
  }
  float* mu = mu_out->typed_data();
  float* nu = nu_out->typed_data();
  // XLA aliases the outputs to the inputs; copy only if it ever did not.
  if (mu != mu_in.typed_data()) {
    std::memcpy(mu, mu_in.typed_data(), mu_in.size_bytes());
  }
  if (nu != nu_in.typed_data()) {
    std::memcpy(nu, nu_in.typed_data(), nu_in.size_bytes());
  }
  const float* h = hyper.typed_data();
  const float b1 = h[0], c1 = h[1], b2 = h[2], c2 = h[3], eps = h[4];
  const float eps_root = h[5], corr = h[6];
  const int32_t* id = ids.typed_data();
  const float* g = grads.typed_data();
  int32_t* out_ids = unique_ids->typed_data();
  float* out = updates->typed_data();

  // 1. Distinct ids: slot s holds out_ids[s] and, in out[s], its summed row.
  int bits = 1;
  while ((int64_t{1} << bits) < 2 * n) ++bits;
  const int shift = 32 - bits;
  const uint32_t mask = (uint32_t{1} << bits) - 1;
  std::vector<int32_t> table(size_t{1} << bits, -1);
  int64_t distinct = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t r = id[i];
    if (r < 0 || r >= rows) continue;
    uint32_t b = Bucket(r, shift);
    while (table[b] >= 0 && out_ids[table[b]] != r) b = (b + 1) & mask;
    const float* gi = g + i * d;
    if (table[b] < 0) {
      table[b] = static_cast<int32_t>(distinct);
      out_ids[distinct] = r;
      std::memcpy(out + distinct * d, gi, d * sizeof(float));
      ++distinct;
    } else {
      float* acc = out + static_cast<int64_t>(table[b]) * d;
      for (int64_t k = 0; k < d; ++k) acc[k] += gi[k];
    }
  }

  // 2. The moments of each distinct row, updated in place, and its step.
  const Moments args{b1, c1, b2, c2, eps, eps_root, corr, mu, nu, out_ids,
                     out, d};
  const int64_t threads = pool.num_threads();
  if (threads <= 1 || distinct * d < kParallelMinValues) {
    UpdateRows(args, 0, distinct);
  } else {
    auto chunks = std::make_shared<Chunks>();
    chunks->args = args;
    chunks->rows = distinct;
    chunks->count = (distinct + kChunkRows - 1) / kChunkRows;
    const int64_t helpers = std::min(threads, chunks->count) - 1;
    for (int64_t h = 0; h < helpers; ++h) {
      pool.Schedule([chunks] { chunks->Work(); });
    }
    chunks->Work();
    while (chunks->done.load(std::memory_order_acquire) < chunks->count) {
      std::this_thread::yield();
    }
  }

  // 3. Unused slots touch no row.
  for (int64_t s = distinct; s < n; ++s) out_ids[s] = static_cast<int32_t>(rows);
  std::memset(out + distinct * d, 0, (n - distinct) * d * sizeof(float));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxAdamRows, AdamRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

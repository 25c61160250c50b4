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
// The moment tables are aliased to outputs 0 and 1: with donated state XLA
// hands the same buffers back, so only the touched rows are read or written.
// Inputs: ids s32[N], grads f32[N, D], hyper f32[7] = (b1, 1 - b1, b2,
// 1 - b2, eps, eps_root, corr) (1 - b computed by the caller, in double
// precision where b is a Python float, as XLA's path does), mu f32[R, D], nu f32[R, D]. Outputs: mu, nu, unique ids s32[N],
// updates f32[N, D].

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPrefetchAhead = 8;

inline uint32_t Bucket(int32_t id, int shift) {
  return (static_cast<uint32_t>(id) * 0x9E3779B1u) >> shift;
}

ffi::Error AdamRows(ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> grads,
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
  for (int64_t s = 0; s < distinct; ++s) {
    if (s + kPrefetchAhead < distinct) {
      const int64_t ahead = out_ids[s + kPrefetchAhead];
      for (int64_t k = 0; k < d; k += 16) {
        __builtin_prefetch(mu + ahead * d + k, 1);
        __builtin_prefetch(nu + ahead * d + k, 1);
      }
    }
    float* m = mu + static_cast<int64_t>(out_ids[s]) * d;
    float* v = nu + static_cast<int64_t>(out_ids[s]) * d;
    float* u = out + s * d;
    for (int64_t k = 0; k < d; ++k) {
      const float gk = u[k];
      const float mk = b1 * m[k] + c1 * gk;
      const float vk = b2 * v[k] + c2 * (gk * gk);
      m[k] = mk;
      v[k] = vk;
      u[k] = corr * mk / (std::sqrt(vk + eps_root) + eps);
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
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

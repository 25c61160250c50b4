// lazy_optax's CPU kernels for `IdTable` (hashed ids), called through XLA's
// FFI. They follow the policy of `id_assign.py` (the XLA path) bit for bit:
// the same hashes, the same claim rounds (the smallest id wins a slot that
// several ids pick), the same sketch, counters and eviction log, so a state
// written by one path is read and continued by the other.
//
// Handlers (Python wrappers in id_kernels.py say what each returns):
//   LazyOptaxIdAssign  slots, fresh slots and event counts of one `assign`;
//                      the state's arrays are updated in place (aliased)
//   LazyOptaxIdFind    the slots of live ids (`capacity` for absent ones)
//
// Tables without `ttl` only: an occupied slot is a live one.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr uint32_t kEmptyWord = 0xFFFFFFFFu;
constexpr uint32_t kHighLimit = 0x80000000u;
constexpr uint32_t kSaltHome = 0x243F6A88u;
constexpr uint32_t kSaltSketch = 0x85A308D3u;
constexpr uint32_t kGolden = 0x9E3779B9u;
constexpr int32_t kCountLimit = 1 << 30;
constexpr int32_t kBigStep = 0x7FFFFFFF;
// Ids prefetched ahead (windows and sketch cells); measured on CPU only
// (`assign` alone, 1,000,000 slots: 1.98 -> 1.85 ms with 8 ahead).
constexpr int64_t kAhead = 8;

enum Eviction : int64_t { kLru = 0, kLfu = 1, kNone = 2 };

inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

inline uint32_t HashWords(const uint32_t* w, uint32_t salt) {
  return Mix32(w[1] ^ Mix32(w[0] ^ salt));
}

// The static configuration of a table (the `IdTable` fields).
struct Config {
  int64_t capacity, probe, eviction, admit_after, rounds, lfu_period;
  uint32_t seed;
  bool has_sketch, all_lookups, guarded;
  int64_t depth, width, log_size;
};

inline int32_t Decayed(int32_t count, int32_t seen, int32_t now,
                       int64_t period) {
  const int64_t halvings =
      now / period - static_cast<int64_t>(std::max(seen, 0)) / period;
  return count >> std::clamp<int64_t>(halvings, 0, 31);
}

// The mutable state arrays (the outputs, aliased to the inputs).
struct State {
  uint32_t* ids;
  int32_t* last_seen;
  int32_t* counts;
  int32_t* sketch;
  uint32_t* log_ids;
  int32_t* log_steps;
};

// Per position facts of one call.
struct Position {
  int32_t home = 0, hit_slot = 0, hit_seen = 0, hit_count = 0, seen = 0;
  bool valid = false, found = false, need = false, admitted = false;
  bool pending = false, stuck = false, blocked = false, declined = false;
  int32_t placed = 0;
  // The placed slot's owner before the call.
  uint32_t old_hi = kEmptyWord, old_lo = kEmptyWord;
  int32_t old_seen = 0;
  bool old_alive = false;
};

class Assigner {
 public:
  Assigner(const Config& cfg, const uint32_t* words, int64_t n, int32_t now,
           int32_t prev, State s)
      : c_(cfg), w_(words), n_(n), now_(now), prev_(prev), s_(s), p_(n) {}

  void Run() {
    Hash();
    Probe();
    Admit();
    for (int64_t i = 0; i < n_; ++i) {
      if (p_[i].found) s_.last_seen[p_[i].hit_slot] = now_;
    }
    for (int64_t r = 0; r < c_.rounds; ++r) {
      if (!Round()) break;
    }
  }

  // Accounting: writes the slots, the fresh slots and the events.
  void Finish(int32_t* slots, int32_t* fresh, int32_t* events,
              int32_t log_next, int32_t log_lost);

 private:
  // Homes and sketch columns first (no memory reads), so that the loops
  // below can prefetch a few ids ahead: each id's window and sketch cells
  // are cache misses on a large table.
  void Hash() {
    const uint32_t homes = static_cast<uint32_t>(c_.capacity - c_.probe + 1);
    if (c_.has_sketch) cols_.resize(n_ * c_.depth);
    for (int64_t i = 0; i < n_; ++i) {
      const uint32_t* w = w_ + 2 * i;
      p_[i].home = static_cast<int32_t>(HashWords(w, kSaltHome ^ c_.seed) %
                                        homes);
      if (c_.has_sketch) Columns(w, &cols_[i * c_.depth]);
    }
  }

  void Columns(const uint32_t* w, int64_t* out) const {
    const uint32_t base = HashWords(w, kSaltSketch ^ c_.seed);
    for (int64_t d = 0; d < c_.depth; ++d) {
      out[d] = d * c_.width +
               Mix32(base ^ static_cast<uint32_t>((d + 1) * kGolden)) %
                   static_cast<uint32_t>(c_.width);
    }
  }

  void PrefetchSketch(int64_t i) const {
    if (i >= n_) return;
    for (int64_t d = 0; d < c_.depth; ++d) {
      __builtin_prefetch(s_.sketch + cols_[i * c_.depth + d]);
    }
  }

  void Probe() {
    for (int64_t i = 0; i < n_; ++i) {
      if (i + kAhead < n_) {
        const int64_t ahead = p_[i + kAhead].home;
        __builtin_prefetch(s_.ids + 2 * ahead);
        __builtin_prefetch(s_.ids + 2 * (ahead + c_.probe) - 1);
        __builtin_prefetch(s_.last_seen + ahead);
        __builtin_prefetch(s_.last_seen + ahead + c_.probe - 1);
        if (c_.eviction == kLfu) {  // read by a hit and by Pick
          __builtin_prefetch(s_.counts + ahead);
          __builtin_prefetch(s_.counts + ahead + c_.probe - 1);
        }
      }
      Position& q = p_[i];
      const uint32_t* w = w_ + 2 * i;
      q.valid = w[0] < kHighLimit;
      for (int64_t j = 0; j < c_.probe && q.valid; ++j) {
        const int64_t slot = q.home + j;
        const uint32_t* owner = s_.ids + 2 * slot;
        if (owner[0] != kEmptyWord && owner[0] == w[0] && owner[1] == w[1]) {
          q.found = true;
          q.hit_slot = static_cast<int32_t>(slot);
          q.hit_seen = s_.last_seen[slot];
          if (c_.eviction == kLfu) q.hit_count = s_.counts[slot];
          break;
        }
      }
      q.need = q.valid && !q.found;
    }
  }

  void Admit() {
    if (!c_.has_sketch) {
      for (Position& q : p_) q.admitted = q.pending = q.need;
      return;
    }
    const int64_t size = c_.depth * c_.width;
    if (c_.all_lookups && prev_ >= 0) {
      const int64_t halvings = now_ / c_.lfu_period - prev_ / c_.lfu_period;
      if (halvings > 0) {
        const int shift = static_cast<int>(std::min<int64_t>(halvings, 31));
        for (int64_t e = 0; e < size; ++e) s_.sketch[e] >>= shift;
      }
    }
    for (int64_t i = 0; i < n_; ++i) {
      PrefetchSketch(i + kAhead);
      if (!(c_.all_lookups ? p_[i].valid : p_[i].need)) continue;
      for (int64_t d = 0; d < c_.depth; ++d) {
        int32_t& cell = s_.sketch[cols_[i * c_.depth + d]];
        cell = std::min(cell + 1, kCountLimit);
      }
    }
    // The counts of the ids without a row (the only ones that claim a
    // slot; as the XLA path, 0 for the others): most of a batch are hits,
    // whose cells need not be read again.
    for (int64_t i = 0; i < n_; ++i) {
      Position& q = p_[i];
      if (!q.need) continue;
      int32_t seen = kBigStep;
      for (int64_t d = 0; d < c_.depth; ++d) {
        seen = std::min(seen, s_.sketch[cols_[i * c_.depth + d]]);
      }
      q.seen = seen;
      q.admitted = c_.admit_after == 1 || seen >= c_.admit_after;
      q.pending = q.admitted;
    }
  }

  // The frequency guard: a claim on a live id's slot stands only when the
  // sketch counts the newcomer more often than the owner (`cols`: the
  // owners' cells); the others are declined and leave `claims`.
  template <typename Claims>
  void Guard(Claims* claims, const std::vector<size_t>& victims,
             const std::vector<int64_t>& cols) {
    std::vector<char> declined(claims->size(), 0);
    for (size_t v = 0; v < victims.size(); ++v) {
      int32_t owner_count = kBigStep;
      for (int64_t d = 0; d < c_.depth; ++d) {
        owner_count = std::min(owner_count, s_.sketch[cols[v * c_.depth + d]]);
      }
      Position& q = p_[(*claims)[victims[v]].i];
      if (!(q.seen > owner_count)) {
        q.declined = true;
        q.pending = false;
        declined[victims[v]] = 1;
      }
    }
    size_t kept = 0;
    for (size_t k = 0; k < claims->size(); ++k) {
      if (!declined[k]) (*claims)[kept++] = (*claims)[k];
    }
    claims->resize(kept);
  }

  // The window position an id picks (probe: none), from the state as it is
  // at the start of the round; `blocked` under 'none'.
  int64_t Pick(const Position& q, bool* blocked) const {
    int64_t best_j = c_.probe;
    int32_t best_score = kBigStep, least = kBigStep;
    *blocked = false;
    for (int64_t j = 0; j < c_.probe; ++j) {
      const int64_t slot = q.home + j;
      const int32_t seen = s_.last_seen[slot];
      if (seen >= now_) continue;  // seen at this step: not eligible
      const bool free = s_.ids[2 * slot] == kEmptyWord;
      if (c_.eviction == kNone && !free) {
        *blocked = true;
        continue;
      }
      int32_t score = 0;
      if (c_.eviction == kLfu) {
        score = free ? -1 : Decayed(s_.counts[slot], seen, now_,
                                    c_.lfu_period);
      }
      if (score < best_score || (score == best_score && seen < least)) {
        best_score = score;
        least = seen;
        best_j = j;
      }
    }
    return best_j;
  }

  // One claim round; false once no id is pending.
  bool Round() {
    struct Claim {
      int32_t slot;
      uint32_t hi, lo;
      int64_t i;
    };
    std::vector<Claim> claims;
    // The claims whose pick holds a live id (under the frequency guard),
    // and that owner's sketch cells (`depth` each), prefetched here and
    // read once every pick is made: each is a cache miss on a large sketch.
    std::vector<size_t> victims;
    std::vector<int64_t> cols;
    bool any = false;
    for (int64_t i = 0; i < n_; ++i) {
      Position& q = p_[i];
      if (!q.pending) continue;
      any = true;
      bool blocked = false;
      const int64_t j = Pick(q, &blocked);
      if (j == c_.probe) {
        q.stuck = true;
        q.blocked = q.blocked || blocked;
        q.pending = false;
        continue;
      }
      const int32_t slot = static_cast<int32_t>(q.home + j);
      const uint32_t* owner = s_.ids + 2 * slot;
      if (c_.guarded && owner[0] != kEmptyWord) {
        victims.push_back(claims.size());
        cols.resize(cols.size() + c_.depth);
        int64_t* cells = cols.data() + cols.size() - c_.depth;
        Columns(owner, cells);
        for (int64_t d = 0; d < c_.depth; ++d) {
          __builtin_prefetch(s_.sketch + cells[d]);
        }
      }
      claims.push_back({slot, ~w_[2 * i], ~w_[2 * i + 1], i});
    }
    if (!victims.empty()) Guard(&claims, victims, cols);
    if (!any) return false;
    // The smallest id wins: the largest complements (as the XLA path).
    std::sort(claims.begin(), claims.end(), [](const Claim& a, const Claim& b) {
      if (a.slot != b.slot) return a.slot < b.slot;
      if (a.hi != b.hi) return a.hi > b.hi;
      return a.lo > b.lo;
    });
    for (size_t k = 0; k < claims.size();) {
      size_t e = k;
      while (e < claims.size() && claims[e].slot == claims[k].slot) ++e;
      const int32_t slot = claims[k].slot;
      uint32_t* owner = s_.ids + 2 * slot;
      const uint32_t old_hi = owner[0], old_lo = owner[1];
      const int32_t old_seen = s_.last_seen[slot];
      for (size_t m = k; m < e; ++m) {
        Position& q = p_[claims[m].i];
        if (claims[m].hi != claims[k].hi || claims[m].lo != claims[k].lo) {
          continue;  // lost: tries again in the next round
        }
        q.pending = false;
        q.placed = slot;
        q.old_hi = old_hi;
        q.old_lo = old_lo;
        q.old_seen = old_seen;
        q.old_alive = old_hi != kEmptyWord;
      }
      owner[0] = ~claims[k].hi;
      owner[1] = ~claims[k].lo;
      s_.last_seen[slot] = now_;
      k = e;
    }
    return true;
  }

 private:
  const Config& c_;
  const uint32_t* w_;
  int64_t n_;
  int32_t now_, prev_;
  State s_;
  std::vector<Position> p_;
  std::vector<int64_t> cols_;  // [n, depth] flat indices into the sketch
};

void Assigner::Finish(int32_t* slots, int32_t* fresh, int32_t* events,
                      int32_t log_next, int32_t log_lost) {
  const int32_t c = static_cast<int32_t>(c_.capacity);
  for (int64_t i = 0; i < n_; ++i) {
    Position& q = p_[i];
    const bool placed = q.admitted && !q.pending && !q.stuck && !q.declined;
    slots[i] = q.found ? q.hit_slot : (placed ? q.placed : c);
  }
  // One representative per slot: its last position. A small open-addressing
  // set of the slots already represented (the batch's, not the table's:
  // it stays in cache; the claims scratch is left untouched, all zero).
  int64_t buckets = 16;
  while (buckets < 2 * n_) buckets <<= 1;
  std::vector<int32_t> taken(buckets, -1);
  std::vector<char> rep(n_, 0);
  for (int64_t i = n_ - 1; i >= 0; --i) {
    if (slots[i] >= c) continue;
    int64_t b = Mix32(static_cast<uint32_t>(slots[i])) & (buckets - 1);
    while (taken[b] >= 0 && taken[b] != slots[i]) b = (b + 1) & (buckets - 1);
    if (taken[b] < 0) {
      taken[b] = slots[i];
      rep[i] = 1;
    }
  }
  int32_t admissions = 0, evictions = 0, rejections = 0, overflows = 0;
  int32_t unadmitted = 0, declined = 0, live_delta = 0, no_room = 0;
  int32_t total = 0;
  for (int64_t i = 0; i < n_; ++i) {
    const Position& q = p_[i];
    const bool inserted = rep[i] && !q.found;
    fresh[i] = inserted ? slots[i] : c;
    admissions += inserted;
    evictions += inserted && q.old_alive;
    live_delta += inserted && !q.old_alive;
    total += inserted && q.old_hi != kEmptyWord;
    const bool lost = q.stuck || q.pending;
    no_room += lost;
    rejections += q.blocked;
    overflows += lost && !q.blocked;
    unadmitted += q.need && !q.admitted;
    declined += q.declined;
    if (c_.eviction == kLfu && rep[i]) {
      int32_t value = 1;
      if (q.found) {
        value = q.hit_seen < now_
                    ? Decayed(q.hit_count, q.hit_seen, now_, c_.lfu_period) + 1
                    : q.hit_count;
        value = std::min(value, kCountLimit);
      }
      s_.counts[slots[i]] = value;
    }
  }
  // The eviction log: the evicted owners, in position order (latest kept).
  const int64_t size = c_.log_size;
  int32_t rank = 0;
  for (int64_t i = 0; i < n_; ++i) {
    const Position& q = p_[i];
    if (!(rep[i] && !q.found && q.old_hi != kEmptyWord)) continue;
    const bool kept = size > 0 && rank >= total - size;
    if (kept) {
      const int64_t entry = (log_next + rank) % size;
      log_lost = std::max(log_lost, s_.log_steps[entry]);
      s_.log_ids[2 * entry] = q.old_hi;
      s_.log_ids[2 * entry + 1] = q.old_lo;
      s_.log_steps[entry] = now_;
    } else {
      log_lost = std::max(log_lost, now_);
    }
    ++rank;
  }
  if (size > 0) log_next = static_cast<int32_t>((log_next + total) % size);
  const int32_t out[] = {admissions, evictions, rejections, overflows,
                         unadmitted, declined,  live_delta, log_next,
                         log_lost,   no_room};
  std::memcpy(events, out, sizeof(out));
}

template <typename T>
T* Aliased(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  void* dst = out->untyped_data();
  if (dst != in.untyped_data()) {
    std::memcpy(dst, in.untyped_data(), in.size_bytes());
  }
  return static_cast<T*>(dst);
}

ffi::Error IdAssign(ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::S32> scalars,
                    ffi::AnyBuffer ids, ffi::AnyBuffer last_seen,
                    ffi::AnyBuffer counts,
                    ffi::AnyBuffer sketch, ffi::AnyBuffer log_ids,
                    ffi::AnyBuffer log_steps,
                    ffi::Result<ffi::Buffer<ffi::S32>> slots,
                    ffi::Result<ffi::Buffer<ffi::S32>> fresh,
                    ffi::Result<ffi::Buffer<ffi::S32>> events,
                    ffi::Result<ffi::AnyBuffer> ids_out,
                    ffi::Result<ffi::AnyBuffer> last_seen_out,
                    ffi::Result<ffi::AnyBuffer> counts_out,
                    ffi::Result<ffi::AnyBuffer> sketch_out,
                    ffi::Result<ffi::AnyBuffer> log_ids_out,
                    ffi::Result<ffi::AnyBuffer> log_steps_out,
                    int64_t capacity, int64_t probe, int64_t eviction,
                    int64_t admit_after, int64_t rounds, int64_t lfu_period,
                    int64_t seed, bool has_sketch, bool all_lookups,
                    bool guarded, int64_t depth, int64_t width,
                    int64_t log_size) {
  const int64_t n = static_cast<int64_t>(words.element_count()) / 2;
  if (scalars.element_count() != 4 || events->element_count() != 10 ||
      static_cast<int64_t>(ids.element_count()) != 2 * capacity ||
      static_cast<int64_t>(last_seen.element_count()) != capacity ||
      probe < 1 || probe > capacity || lfu_period < 1 || depth < 1 ||
      depth > 16 ||
      (has_sketch &&
       static_cast<int64_t>(sketch.element_count()) != depth * width) ||
      static_cast<int64_t>(log_steps.element_count()) <
          std::max<int64_t>(log_size, 1)) {
    return ffi::Error::InvalidArgument("LazyOptaxIdAssign: operand shapes");
  }
  const Config cfg{capacity, probe, eviction, admit_after,
                   rounds, lfu_period, static_cast<uint32_t>(seed),
                   has_sketch, all_lookups, guarded, depth, width, log_size};
  const int32_t* s = scalars.typed_data();
  State st{Aliased<uint32_t>(ids, ids_out),
           Aliased<int32_t>(last_seen, last_seen_out),
           Aliased<int32_t>(counts, counts_out),
           Aliased<int32_t>(sketch, sketch_out),
           Aliased<uint32_t>(log_ids, log_ids_out),
           Aliased<int32_t>(log_steps, log_steps_out)};
  Assigner a(cfg, words.typed_data(), n, s[0], s[1], st);
  a.Run();
  a.Finish(slots->typed_data(), fresh->typed_data(), events->typed_data(),
           s[2], s[3]);
  return ffi::Error::Success();
}

ffi::Error IdFind(ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::U32> ids,
                  ffi::Result<ffi::Buffer<ffi::S32>> slots, int64_t capacity,
                  int64_t probe, int64_t seed) {
  const int64_t n = static_cast<int64_t>(words.element_count()) / 2;
  if (static_cast<int64_t>(ids.element_count()) != 2 * capacity ||
      probe < 1 || probe > capacity) {
    return ffi::Error::InvalidArgument("LazyOptaxIdFind: operand shapes");
  }
  const uint32_t* w = words.typed_data();
  const uint32_t* table = ids.typed_data();
  const uint32_t homes = static_cast<uint32_t>(capacity - probe + 1);
  int32_t* out = slots->typed_data();
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<int32_t>(capacity);
    if (w[2 * i] >= kHighLimit) continue;
    const int64_t home =
        HashWords(w + 2 * i, kSaltHome ^ static_cast<uint32_t>(seed)) % homes;
    for (int64_t j = 0; j < probe; ++j) {
      const uint32_t* owner = table + 2 * (home + j);
      if (owner[0] == w[2 * i] && owner[1] == w[2 * i + 1]) {
        out[i] = static_cast<int32_t>(home + j);
        break;
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxIdAssign, IdAssign,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("probe")
                                  .Attr<int64_t>("eviction")
                                  .Attr<int64_t>("admit_after")
                                  .Attr<int64_t>("rounds")
                                  .Attr<int64_t>("lfu_period")
                                  .Attr<int64_t>("seed")
                                  .Attr<bool>("has_sketch")
                                  .Attr<bool>("all_lookups")
                                  .Attr<bool>("guarded")
                                  .Attr<int64_t>("depth")
                                  .Attr<int64_t>("width")
                                  .Attr<int64_t>("log_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LazyOptaxIdFind, IdFind,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("capacity")
                                  .Attr<int64_t>("probe")
                                  .Attr<int64_t>("seed"));

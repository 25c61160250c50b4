"""A plain-Python model of `IdTable`'s policy, independent of lazy_optax.

The model follows the documented policy id by id, with dicts and loops and
a full scan of the table where convenient (it is a model, not fast):

* an id's window is the `probe` slots from its home slot `hash(id) mod
  (capacity - probe + 1)` (the 32-bit mix below, the documented hash);
* an id is live while `step - last_seen <= ttl`; a live id found in its
  window keeps its slot and is marked seen;
* a missing id is admitted once a count-min sketch (`sketch_depth` rows of
  `sketch_width` columns, `16 * capacity` by default) of its lookups reaches
  `admit_after` (under `admission='frequency'` the sketch counts every
  lookup and is halved at each `lfu_period` boundary; under `'always'` it
  counts lookups of ids without a row and never decays);
* in each of `rounds` rounds every unplaced admitted id picks, among the
  window slots not seen at this step, the free ones first, then the
  policy's victim, ties to the earlier slot; under
  `admission='frequency'` an id whose pick holds a live id takes it only
  when the sketch counts it more often than that id, else it is declined
  (no row this step, no further round); the smallest id wins a slot
  several pick; the rest try again;
* counters, the live count and the evicted ids follow from the events.
"""

from __future__ import annotations

import numpy as np

M32 = 0xFFFFFFFF
EMPTY = -1
EMPTY_STEP = -(2 ** 30)
SALT_HOME = 0x243F6A88
SALT_SKETCH = 0x85A308D3
GOLDEN = 0x9E3779B9
COUNT_LIMIT = 2 ** 30


def mix32(x: int) -> int:
  x &= M32
  x ^= x >> 16
  x = (x * 0x7FEB352D) & M32
  x ^= x >> 15
  x = (x * 0x846CA68B) & M32
  return x ^ (x >> 16)


def hash_id(raw: int, salt: int) -> int:
  return mix32((raw & M32) ^ mix32((raw >> 32) ^ salt))


class IdTableModel:
  """The policy of `lazy_optax.IdTable`, one id at a time."""

  def __init__(self, capacity, probe=16, eviction='lfu', admit_after=1,
               ttl=None, rounds=4, lfu_period=1000, sketch_depth=2,
               sketch_width=None, seed=0, admission='frequency'):
    self.c, self.p, self.eviction = capacity, probe, eviction
    self.frequency = admission == 'frequency' and eviction != 'none'
    self.all_lookups = admission == 'frequency'
    self.has_sketch = admit_after > 1 or self.frequency
    self.admit_after, self.ttl, self.rounds = admit_after, ttl, rounds
    self.lfu_period, self.seed = lfu_period, seed
    self.depth = sketch_depth
    self.width = sketch_width or min(16 * capacity, 2 ** 31 - 1)
    self.ids = [EMPTY] * capacity
    self.last_seen = [EMPTY_STEP] * capacity
    self.counts = [0] * capacity
    self.sketch = np.zeros((self.depth, self.width), np.int64)
    self.step = -1
    self.counters = dict(admissions=0, evictions=0, expirations=0,
                         rejections=0, overflows=0, unadmitted=0, declined=0)
    self.evicted_at: list[tuple[int, int]] = []   # (id, step it lost its row)

  # -- helpers ---------------------------------------------------------------

  def home(self, raw):
    return hash_id(raw, SALT_HOME ^ self.seed) % (self.c - self.p + 1)

  def columns(self, raw):
    base = hash_id(raw, SALT_SKETCH ^ self.seed)
    return [mix32(base ^ (((d + 1) * GOLDEN) & M32)) % self.width
            for d in range(self.depth)]

  def alive(self, slot, now):
    if self.ids[slot] == EMPTY:
      return False
    return self.ttl is None or self.last_seen[slot] >= now - self.ttl

  def decayed(self, count, seen, now):
    halvings = now // self.lfu_period - max(seen, 0) // self.lfu_period
    return count >> min(max(halvings, 0), 31)

  def estimate(self, raw):
    return min(self.sketch[d, col] for d, col in enumerate(self.columns(raw)))

  def live(self):
    return sum(self.alive(s, self.step) for s in range(self.c))

  def find(self, raw):
    if raw < 0:
      return self.c
    h = self.home(raw)
    for s in range(h, h + self.p):
      if self.alive(s, max(self.step, 0)) and self.ids[s] == raw:
        return s
    return self.c

  # -- assign ----------------------------------------------------------------

  def assign(self, raw_ids, step):
    now = max(step, self.step)
    prev = self.step
    if self.ttl is not None and prev >= 0:
      for s in range(self.c):
        if self.ids[s] != EMPTY and (
            prev - self.ttl <= self.last_seen[s] < now - self.ttl):
          self.counters['expirations'] += 1
    raw_ids = [int(x) for x in raw_ids]
    old_ids, old_seen = list(self.ids), list(self.last_seen)
    old_alive = [self.alive(s, now) for s in range(self.c)]
    found = {}
    for x in set(raw_ids):
      if x < 0:
        continue
      h = self.home(x)
      for s in range(h, h + self.p):
        if old_alive[s] and old_ids[s] == x:
          found[x] = s
    need = [x for x in raw_ids if x >= 0 and x not in found]
    admitted = set()
    if self.has_sketch:
      if self.all_lookups and prev >= 0:
        halvings = now // self.lfu_period - prev // self.lfu_period
        self.sketch >>= min(max(halvings, 0), 31)
      counted = [x for x in raw_ids if x >= 0] if self.all_lookups else need
      for x in counted:
        for d, col in enumerate(self.columns(x)):
          self.sketch[d, col] = min(self.sketch[d, col] + 1, COUNT_LIMIT)
    if self.admit_after > 1:
      admitted = {x for x in need if self.estimate(x) >= self.admit_after}
    else:
      admitted = set(need)
    self.counters['unadmitted'] += sum(x not in admitted for x in need)
    for x, s in found.items():
      if self.eviction == 'lfu':
        if old_seen[s] < now:
          self.counts[s] = min(
              self.decayed(self.counts[s], old_seen[s], now) + 1,
              COUNT_LIMIT)
      self.last_seen[s] = now

    def score(s):
      if not old_alive[s]:
        return -1
      return self.decayed(self.counts[s], old_seen[s], now)

    placed, stuck, blocked, declined = {}, set(), set(), set()
    pending = sorted(admitted)
    for _ in range(self.rounds):
      if not pending:
        break
      claims = {}
      for x in pending:
        h = self.home(x)
        window = [s for s in range(h, h + self.p) if self.last_seen[s] < now]
        if self.eviction == 'none':
          eligible = [s for s in window if not old_alive[s]]
        else:
          eligible = window
        if not eligible:
          stuck.add(x)
          if self.eviction == 'none' and any(old_alive[s] for s in window):
            blocked.add(x)
          continue
        if self.eviction == 'lfu':
          best = min(score(s) for s in eligible)
          eligible = [s for s in eligible if score(s) == best]
        least = min(old_seen[s] for s in eligible)
        choice = min(s for s in eligible if old_seen[s] == least)
        if self.frequency and old_alive[choice] and not (
            self.estimate(x) > self.estimate(old_ids[choice])):
          declined.add(x)
          continue
        claims.setdefault(choice, []).append(x)
      for s, xs in claims.items():
        x = min(xs)
        placed[x] = s
        self.ids[s] = x
        self.last_seen[s] = now
        if self.eviction == 'lfu':
          self.counts[s] = 1
      pending = [x for x in pending
                 if x not in placed and x not in stuck and x not in declined]
    stuck |= set(pending)
    for x, s in placed.items():
      self.counters['admissions'] += 1
      if old_ids[s] != EMPTY:
        if old_alive[s]:
          self.counters['evictions'] += 1
          self.evicted_at.append((old_ids[s], now))
        else:
          self.evicted_at.append((old_ids[s], old_seen[s] + self.ttl + 1))
    for x in raw_ids:
      if x in declined:
        self.counters['declined'] += 1
      if x in stuck:
        if x in blocked:
          self.counters['rejections'] += 1
        else:
          self.counters['overflows'] += 1
    self.step = now
    slots = [found.get(x, placed.get(x, self.c)) if x >= 0 else self.c
             for x in raw_ids]
    fresh = {s: x for x, s in placed.items()}
    return np.array(slots, np.int64), fresh

  # -- export ----------------------------------------------------------------

  def export(self, since):
    now = self.step
    changed = {s: self.ids[s] for s in range(self.c)
               if self.alive(s, now) and self.last_seen[s] >= since}
    live_ids = {self.ids[s] for s in range(self.c) if self.alive(s, now)}
    evicted = {x for x, at in self.evicted_at if at >= since}
    if self.ttl is not None:
      for s in range(self.c):
        if self.ids[s] != EMPTY and not self.alive(s, now) and (
            self.last_seen[s] + self.ttl + 1 >= since):
          evicted.add(self.ids[s])
    return changed, sorted(evicted - live_ids)

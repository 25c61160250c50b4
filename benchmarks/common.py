"""What every benchmark shares: the workloads, their id batches, the timing.

numpy only at import time: the TF and FBGEMM contenders import this module
in interpreters of their own (their virtual environments pin other numpy
versions and have neither JAX nor lazy_optax).

Two workloads:

- the single table (`TARGET`): a `[rows, row]` float32 table and a `[row]`
  weight, `loss = mean((table[ids] @ w - 1)^2)`, 4,096 Zipf ids a step;
- the DLRM-shaped model (`DLRM_DEFAULTS`): 26 tables with the Criteo Kaggle
  categorical cardinalities capped at `cap` rows, `row` floats a row, a batch
  of `batch` examples with one Zipf id per table, 13 dense features and a
  0/1 label, an MLP (`mlp` hidden ReLU layers and a logit), logistic loss.

Every contender of a configuration draws the same ids (`make_batches`,
`make_dlrm_batches`) and reports their `ids_digest`, so that the report can
check it.
"""

from __future__ import annotations

import os
import resource
import time
import zlib

import numpy as np

LR = 1e-3
TARGET = {'rows': 1_000_000, 'row': 64, 'ids': 4096, 'dist': 'zipf'}

# Criteo Kaggle (Display Advertising Challenge) categorical cardinalities.
CRITEO_KAGGLE = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145,
                 5683, 8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4,
                 7046547, 18, 15, 286181, 105, 142572)
DLRM_DEFAULTS = {'cap': 1_000_000, 'row': 16, 'batch': 2048, 'dense': 13,
                 'mlp': [64], 'dist': 'zipf'}


# -- memory -------------------------------------------------------------------


def rss_mb() -> float:
  """This process's resident memory now, in MiB."""
  try:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20
  except OSError:
    return float('nan')


def peak_rss_mb() -> float:
  """This process's peak resident memory (`ru_maxrss`), in MiB."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- ids ----------------------------------------------------------------------


def make_batches(cfg: dict) -> list[np.ndarray]:
  """`cfg['pool']` int32 id batches of `cfg['ids']` ids in `[0, cfg['rows'])`.

  `cfg['dist']` is 'zipf' (Zipf(`zipf_s`, default 1) over ranks; the ranks
  land on a random permutation of the rows, so hot rows are spread over the
  table as hashed ids are) or 'uniform'; `cfg['seed']` defaults to 0.
  """
  v, n = cfg['rows'], cfg['ids']
  rng = np.random.default_rng(cfg.get('seed', 0))
  if cfg['dist'] == 'zipf':
    weights = 1.0 / np.arange(1, v + 1, dtype=np.float64) ** cfg.get('zipf_s',
                                                                     1.0)
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    perm = rng.permutation(v).astype(np.int32)
    return [perm[np.minimum(np.searchsorted(cdf, rng.random(n)), v - 1)]
            for _ in range(cfg['pool'])]
  if cfg['dist'] == 'uniform':
    return [rng.integers(0, v, n).astype(np.int32) for _ in range(cfg['pool'])]
  raise ValueError(f'unknown id distribution {cfg["dist"]!r}')


def ids_digest(batches: list[np.ndarray]) -> str:
  """A short digest of id batches: equal digests, equal ids in every library."""
  h = zlib.crc32(b'')
  for b in batches:
    h = zlib.crc32(np.ascontiguousarray(b, dtype=np.int64).tobytes(), h)
  return f'{h:08x}'


def lazy_step_bytes(batches: list[np.ndarray], row_bytes: int,
                    dense_bytes: int = 0) -> dict:
  """Bytes that a lazy Adam train step must move, per step (mean over batches).

  Read: the ids (4 bytes each), the looked-up rows (one per id), the gradient
  rows (one per id), and the touched rows of the parameter, `mu` and `nu`;
  written: those three sets of touched rows. Dense parameters of `dense_bytes`
  bytes add their gradient (read) and the parameter, `mu` and `nu` (read and
  written). This is the traffic that an ideal implementation cannot avoid;
  divided by the step time it gives the step's effective bandwidth.
  """
  n = float(np.mean([b.size for b in batches]))
  u = float(np.mean([np.unique(b).size for b in batches]))
  read = 4 * n + 2 * n * row_bytes + 3 * u * row_bytes + 4 * dense_bytes
  written = 3 * u * row_bytes + 3 * dense_bytes
  return {'ids': n, 'unique_rows': u, 'bytes_read': read,
          'bytes_written': written, 'bytes': read + written}


# -- the DLRM-shaped model ----------------------------------------------------


def cardinalities(cfg: dict) -> list[int]:
  """Rows of the 26 tables: Criteo Kaggle's, capped at `cfg['cap']`."""
  return [min(c, cfg['cap']) for c in CRITEO_KAGGLE]


def make_dlrm_batches(cfg: dict) -> list[dict[str, np.ndarray]]:
  """`pool` batches: ids [batch, 26] int32, dense [batch, 13], labels."""
  cards = cardinalities(cfg)
  per_table = [make_batches({'rows': c, 'ids': cfg['batch'],
                             'dist': cfg['dist'], 'pool': cfg['pool'],
                             'seed': 1000 + t})
               for t, c in enumerate(cards)]
  rng = np.random.default_rng(7)
  out = []
  for k in range(cfg['pool']):
    out.append({
        'ids': np.stack([per_table[t][k] for t in range(len(cards))], 1),
        'dense': rng.normal(size=(cfg['batch'], cfg['dense'])).astype(
            np.float32),
        'labels': (rng.random(cfg['batch']) < 0.25).astype(np.float32),
    })
  return out


def mlp_shapes(cfg: dict) -> list[tuple[int, int]]:
  """(inputs, outputs) of each MLP layer of the DLRM-shaped model."""
  sizes = [len(CRITEO_KAGGLE) * cfg['row'] + cfg['dense'], *cfg['mlp'], 1]
  return list(zip(sizes[:-1], sizes[1:]))


def init_tables(cfg: dict, rng: np.random.Generator) -> list[np.ndarray]:
  """The 26 float32 tables, uniform in [-0.01, 0.01)."""
  return [rng.random((c, cfg['row']), dtype=np.float32) * np.float32(0.02)
          - np.float32(0.01) for c in cardinalities(cfg)]


def init_mlp(cfg: dict, rng: np.random.Generator) -> list[tuple]:
  """(weight [in, out], bias [out]) of each MLP layer, float32."""
  return [((rng.normal(size=(i, o)) / np.sqrt(i)).astype(np.float32),
           np.zeros((o,), np.float32)) for i, o in mlp_shapes(cfg)]


# -- timing -------------------------------------------------------------------


def stats(samples: list[float]) -> dict:
  """Median, p10, p90 and minimum (ms) of step times given in seconds."""
  a = np.asarray(samples) * 1e3
  return {
      'median_ms': float(np.median(a)),
      'p10_ms': float(np.percentile(a, 10)),
      'p90_ms': float(np.percentile(a, 90)),
      'min_ms': float(a.min()),
      'n': int(a.size),
  }


def time_loop(step, n_batches: int, cfg: dict) -> dict:
  """Warm-up, then times single steps until `steps` or `budget_s` is reached.

  `step(k)` runs one step on batch `k` and returns when it is done;
  `cfg` holds `warmup`, `steps`, `min_steps` and `budget_s`.
  """
  for k in range(cfg['warmup']):
    step(k % n_batches)
  samples: list[float] = []
  deadline = time.perf_counter() + cfg['budget_s']
  k = 0
  while len(samples) < cfg['steps'] and (
      len(samples) < cfg['min_steps'] or time.perf_counter() < deadline):
    t0 = time.perf_counter()
    step(k % n_batches)
    samples.append(time.perf_counter() - t0)
    k += 1
  return stats(samples)


# -- interleaving -------------------------------------------------------------

# Marks the lines of a contender process that carry its JSON answers (the
# libraries may print lines of their own).
MARK = '@@bench '


def _largest_cache_bytes() -> int:
  """The CPU's largest cache (Linux sysfs), or 0 where it is not known."""
  sizes = []
  base = '/sys/devices/system/cpu/cpu0/cache'
  for index in (os.listdir(base) if os.path.isdir(base) else ()):
    try:
      with open(os.path.join(base, index, 'size')) as f:
        text = f.read().strip()
    except OSError:
      continue
    scale = {'K': 2**10, 'M': 2**20, 'G': 2**30}.get(text[-1:], 1)
    digits = text.rstrip('KMG')
    if digits.isdigit():
      sizes.append(int(digits) * scale)
  return max(sizes, default=0)


def cache_flusher(nbytes: int = 0):
  """A function that writes `nbytes` of memory, so that what runs next finds
  none of its data in the CPU's caches.

  Every contender's timed step starts that way (`interleave`), so that
  none is timed warm and another cold: a step would otherwise find the
  caches as the step before it left them, its own hot rows still there
  after its own step, all of them gone after a dense `optax.adam` step.
  Measured on a 2-core AMD EPYC (32 MiB L3, 1 thread), a 1,000,000 x 64
  table's step took 0.83 ms warm and 1.36 ms after such a write for
  `lazy_adam`, 1.06 and 1.70 ms for TF Addons' `LazyAdam`.

  Args:
    nbytes: how much to write; 0 (the default): twice the CPU's largest
      cache, at least 64 MiB.

  Returns:
    A function of no arguments; its `nbytes` attribute says how much it
    writes.

  Example:
    >>> flush = cache_flusher(1 << 20)
    >>> flush(); flush.nbytes
    1048576
  """
  nbytes = nbytes or max(64 * 2**20, 2 * _largest_cache_bytes())
  buf = np.zeros(nbytes // 4, np.float32)

  def flush() -> None:
    np.add(buf, 1.0, out=buf)

  flush.nbytes = buf.nbytes  # type: ignore[attr-defined]
  return flush


def interleave(steps: dict, plans: dict, before=None) -> dict:
  """Times several contenders' steps in turn, one step of each at a time.

  Args:
    steps: name -> `step(k)`, one step on batch `k` (any `k`: it wraps),
      returning when the step is done.
    plans: name -> `(warmup, steps, min_steps, budget_s)`: a contender takes
      `warmup` untimed steps, then timed steps until it has `steps` of them,
      or `min_steps` and `budget_s` seconds of its own step time.
    before: a function of no arguments called, untimed, before every step
      (`serve` passes a `cache_flusher`); None: nothing.

  Returns:
    name -> `stats` of its timed steps, or `{'error': ...}` for a contender
    whose step raised (it is dropped from the rest of the run).

  Example:
    >>> out = interleave({'a': lambda k: None}, {'a': (1, 3, 2, 0.0)})
    >>> out['a']['n']  # min_steps, the (zero) budget spent
    2
  """
  samples: dict = {n: [] for n in steps}
  spent = dict.fromkeys(steps, 0.0)
  out: dict = {}

  def wants(n):
    warmup, most, least, budget = plans[n]
    got = len(samples[n])
    return n not in out and got < most + warmup and (
        got < least + warmup or spent[n] < budget)

  k = 0
  while any(wants(n) for n in steps):
    for n in [n for n in steps if wants(n)]:
      if before is not None:
        before()
      t0 = time.perf_counter()
      try:
        steps[n](k)
      except Exception as e:  # pylint: disable=broad-except
        out[n] = {'error': f'{type(e).__name__}: {str(e)[:300]}'}
        continue
      dt = time.perf_counter() - t0
      samples[n].append(dt)
      if len(samples[n]) > plans[n][0]:
        spent[n] += dt
    k += 1
  for n in steps:
    out.setdefault(n, stats(samples[n][plans[n][0]:]))
  return out


def _answer(obj: dict) -> None:
  import json  # pylint: disable=g-import-not-at-top
  print(MARK + json.dumps(obj), flush=True)


def serve(build) -> None:
  """A contender process: builds its contenders, then times them in rounds.

  `sys.argv[1]` is a JSON list of configurations, one a contender, all of
  one workload and thread count. `build(cfg)` returns `(info, steps)`:
  `info` a dict of facts (compile time, ids digest, ...), `steps` a dict
  with `'train'` and optionally `'opt'`, each a `step(k)`; it raises
  `ImportError` when its framework is missing (the contender is then
  skipped). The process answers once built, then once for each `round`
  line on stdin (each contender's `train` steps interleaved step by step
  with the others', then their `opt` steps, each step after a
  `cache_flusher`'s write), and ends at EOF. Answers are JSON on lines
  starting with `MARK`.
  """
  import json  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  made = {}
  for cfg in json.loads(sys.argv[1]):
    before = rss_mb()
    try:
      info, steps = build(cfg)
    except ImportError as e:
      info, steps = {'skipped': f'{e} (in {sys.executable})'}, {}
    info['rss_added_mb'] = rss_mb() - before
    made[cfg['contender']] = (cfg, info, steps)
  flush = cache_flusher()
  for _, info, _ in made.values():
    info['flush_bytes'] = flush.nbytes
  _answer({n: info for n, (_, info, _) in made.items()})
  for line in sys.stdin:
    if line.strip() != 'round':
      break
    answer: dict = {n: {} for n in made}
    for part in ('train', 'opt'):
      fns = {n: s[part] for n, (_, _, s) in made.items() if part in s}
      plans = {n: tuple(made[n][0]['plan'][part]) for n in fns}
      for n, res in interleave(fns, plans, before=flush).items():
        answer[n][part] = res
    for n in answer:
      answer[n]['peak_rss_mb'] = peak_rss_mb()
    _answer(answer)

"""Hashed-id train step against the fixed-table step, and `assign` vs FBGEMM.

Run from the repository root:

    python3 -m benchmarks.experiments.hashed_table            # full size
    python3 -m benchmarks.experiments.hashed_table --quick    # a smoke run

Three measurements, on one stream of Zipf ids (exponent `--zipf`) from a
universe of `--universe` raw ids (10**9), `--batch` ids a step (4,096):

1. **Train step.** The hashed step (`IdTable.assign` + `reset_rows` +
   `lookup` + `value_and_grad` + `lazy_adam` update, everything donated, a
   `[capacity, dim]` table, 1,000,000 x 64) against the fixed-table step
   (the same model with `id % capacity` as the row: `lookup` +
   `value_and_grad` + `lazy_adam`), timed interleaved step by step after the
   table is full. Prints both medians and their ratio. Then it checks that
   the compiled hashed step holds no table-sized array other than the
   donated ones: no table-sized `copy` in `compiled.as_text()`, and
   temporary memory (`memory_analysis()`) below one `[capacity]` int32
   array.
2. **`assign` and `find` alone**: ids per second, and the fraction of
   lookups that got a row of their own (with `IdTable` always all of those
   that got a row: no two ids share one).
3. **FBGEMM's `zero_collision_hash`** (`fbgemm-gpu-cpu`), run by
   `fbgemm_zch_contender.py` in its own interpreter (`--fbgemm-python`,
   default `$LAZY_OPTAX_FBGEMM_PYTHON`) on the same stream: ids per
   second of its CPU op, and the fraction of lookups that got their own
   row. Its CPU op is read-only (inference: it refuses `readonly=False`);
   inserting exists only in its CUDA op. The contender inserts the way
   that op does (the first empty slot of the murmur-hashed probe window,
   else the fallback row shared with other ids; eviction only by TTL in
   hours, so none within a run) on the host, and times the CPU lookups.

4. **Initial rows keyed by raw id**: `reset_rows`' counter-based hash keys
   against threefry keys folded from each id, for `normal` and `uniform`
   rows of the whole batch.

The loss is `mean((rows @ w - 1)^2)` with `w` a `[dim]` weight. The table
takes `IdTable`'s default `eviction` unless `--eviction` names one
(`--eviction lru` for the default before `'lfu'`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import peers


def zipf_stream(universe: int, batch: int, steps: int, exponent: float,
                seed: int) -> np.ndarray:
  """`[steps, batch]` int64 raw ids: Zipf ranks scattered over the universe.

  Ranks (1 = hottest) are drawn from numpy's Zipf law and clipped to the
  universe; rank `r` becomes the id `(r * 2654435761 + 12345) mod
  universe`, a bijection (the multiplier is prime to 10**9), so hot ids are
  spread over the id space like real hashed ids.
  """
  rng = np.random.default_rng(seed)
  ranks = np.minimum(rng.zipf(exponent, (steps, batch)), universe) - 1
  return (ranks.astype(np.int64) * 2654435761 + 12345) % universe


def _median_ms(samples: list[float]) -> float:
  return float(np.median(samples) * 1e3)


def _table_sized_copies(hlo: str, capacity: int) -> list[str]:
  """HLO lines that copy or broadcast an array of >= capacity rows."""
  out = []
  for line in hlo.splitlines():
    m = re.match(r'\s*(?:ROOT )?%\S+ = \w+\[(\d+)[,\]]\S* (copy|broadcast)'
                 r'(?:-start)?\(', line)
    if m and int(m.group(1)) >= capacity:
      out.append(line.strip()[:160])
  return out


def eviction(args: argparse.Namespace) -> dict:
  """`IdTable`'s `eviction` argument from `--eviction` (None: its default)."""
  return {} if args.eviction is None else {'eviction': args.eviction}


def hashed_train_step(table_ids, tx, init, key):
  """The hashed train step: `assign` + `reset_rows` + `lookup` + update.

  Returns `step(params, opt_state, id_state, words, step)` ->
  `(params, opt_state, id_state, loss)`, not jitted; the loss is
  `mean((rows @ w - 1)^2)`.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import lazy_optax  # pylint: disable=g-import-not-at-top

  def loss_fn(params, slots):
    rows = lazy_optax.lookup(params['table'], slots)
    return jnp.mean((rows @ params['w'] - 1.0) ** 2)

  def step(params, opt_state, id_state, words, step):
    slots, id_state, fresh = table_ids.assign(id_state, words, step=step)
    params, opt_state = lazy_optax.reset_rows(
        tx, params, opt_state, {'table': fresh}, init=init, key=key)
    loss, grads = lazy_optax.value_and_grad(loss_fn)(params, slots)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (lazy_optax.apply_updates(params, updates), opt_state, id_state,
            loss)
  return step


def train_steps(args: argparse.Namespace, stream: np.ndarray) -> dict:
  """Part 1: the hashed step against the fixed-table step, interleaved."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import lazy_optax  # pylint: disable=g-import-not-at-top

  cap, dim = args.capacity, args.dim
  tx = lazy_optax.lazy_adam(1e-3)
  init = jax.nn.initializers.normal(0.01)
  key = jax.random.key(0)
  table_ids = lazy_optax.IdTable(capacity=cap, probe=args.probe,
                                 eviction_log=0, **eviction(args))

  def loss_fn(params, rows_ids):
    rows = lazy_optax.lookup(params['table'], rows_ids)
    return jnp.mean((rows @ params['w'] - 1.0) ** 2)

  def fixed_step(params, opt_state, ids):
    loss, grads = lazy_optax.value_and_grad(loss_fn)(params, ids)
    updates, opt_state = tx.update(grads, opt_state, params)
    return lazy_optax.apply_updates(params, updates), opt_state, loss

  hashed_step = hashed_train_step(table_ids, tx, init, key)

  def fresh_params(seed):
    k = jax.random.key(seed)
    return {'table': jax.random.normal(k, (cap, dim)) * 0.01,
            'w': jnp.ones((dim,), jnp.float32)}

  fixed = jax.jit(fixed_step, donate_argnums=(0, 1))
  hashed = jax.jit(hashed_step, donate_argnums=(0, 1, 2))
  words = lazy_optax.split_ids(stream)
  folded = (stream % cap).astype(np.int32)

  p_fix = fresh_params(1)
  s_fix = tx.init(p_fix)
  p_hash = fresh_params(1)
  s_hash = tx.init(p_hash)
  ids_state = table_ids.init()

  t0 = time.perf_counter()
  compiled = hashed.lower(p_hash, s_hash, ids_state, words[0],
                          jnp.int32(0)).compile()
  compile_s = time.perf_counter() - t0
  copies = _table_sized_copies(compiled.as_text(), cap)
  memory = compiled.memory_analysis()
  temp_bytes = int(memory.temp_size_in_bytes) if memory else -1
  # The same step for a table twice as large (compiled, not run): its
  # temporary memory must be the same, or something table-sized is in it.
  big_ids = lazy_optax.IdTable(capacity=2 * cap, probe=args.probe,
                               eviction_log=0, **eviction(args))
  big_params = {'table': jax.ShapeDtypeStruct((2 * cap, dim), jnp.float32),
                'w': jax.ShapeDtypeStruct((dim,), jnp.float32)}

  big_step = hashed_train_step(big_ids, tx, init, key)
  big = jax.jit(big_step, donate_argnums=(0, 1, 2)).lower(
      big_params, jax.eval_shape(tx.init, big_params),
      jax.eval_shape(big_ids.init), words[0], jnp.int32(0)).compile()
  big_memory = big.memory_analysis()
  big_temp_bytes = int(big_memory.temp_size_in_bytes) if big_memory else -1

  fill = args.fill_steps
  for k in range(fill):
    p_hash, s_hash, ids_state, _ = hashed(p_hash, s_hash, ids_state,
                                          words[k], jnp.int32(k))
  for k in range(args.warmup):
    p_fix, s_fix, _ = fixed(p_fix, s_fix, folded[k])
  jax.block_until_ready((p_hash, p_fix))
  filled = table_ids.stats(ids_state)

  t_fix, t_hash, fresh_counts = [], [], []
  before = table_ids.stats(ids_state)['admissions']
  for k in range(fill, fill + args.steps):
    t0 = time.perf_counter()
    p_fix, s_fix, loss = fixed(p_fix, s_fix, folded[k])
    loss.block_until_ready()
    t_fix.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    p_hash, s_hash, ids_state, loss = hashed(p_hash, s_hash, ids_state,
                                             words[k], jnp.int32(k))
    loss.block_until_ready()
    t_hash.append(time.perf_counter() - t0)
  after = table_ids.stats(ids_state)
  fresh_counts.append((after['admissions'] - before) / args.steps)
  fixed_ms, hashed_ms = _median_ms(t_fix), _median_ms(t_hash)
  return {
      'fixed_step_ms': fixed_ms,
      'hashed_step_ms': hashed_ms,
      'ratio': hashed_ms / fixed_ms,
      'compile_s': compile_s,
      'table_sized_copies': copies,
      'temp_bytes': temp_bytes,
      'temp_bytes_2x_capacity': big_temp_bytes,
      'live_after_fill': filled['live'],
      'fresh_rows_per_step': fresh_counts[0],
      'stats': after,
  }


def assign_alone(args: argparse.Namespace, stream: np.ndarray) -> dict:
  """Part 2: `assign` and `find` alone (ids per second, own-row fraction)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import lazy_optax  # pylint: disable=g-import-not-at-top

  cap = args.capacity
  table_ids = lazy_optax.IdTable(capacity=cap, probe=args.probe,
                                 eviction_log=0, **eviction(args))
  assign = jax.jit(lambda s, w, step: table_ids.assign(s, w, step=step)[:2],
                   donate_argnums=0)
  find = jax.jit(table_ids.find)
  words = lazy_optax.split_ids(stream)
  state = table_ids.init()
  fill = args.fill_steps
  for k in range(fill):
    _, state = assign(state, words[k], jnp.int32(k))
  t_assign, t_find, own = [], [], []
  for k in range(fill, fill + args.steps):
    w = jnp.asarray(words[k])
    t0 = time.perf_counter()
    found = find(state, w)
    found.block_until_ready()
    t_find.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    slots, state = assign(state, w, jnp.int32(k))
    slots.block_until_ready()
    t_assign.append(time.perf_counter() - t0)
    own.append(float(np.mean(np.asarray(slots) < cap)))
  n = stream.shape[1]
  return {
      'assign_ms': _median_ms(t_assign),
      'assign_ids_per_s': n / np.median(t_assign),
      'find_ms': _median_ms(t_find),
      'find_ids_per_s': n / np.median(t_find),
      'own_row_fraction': float(np.mean(own)),
      'stats': table_ids.stats(state),
  }


def init_cost(args: argparse.Namespace, stream: np.ndarray) -> dict:
  """Part 4: initial rows for a batch of raw ids, keyed by the raw id.

  `reset_rows`' keys (a counter-based hash PRNG: integer mixing of the key
  and the id) against threefry keys folded from the id (`fold_in` of both
  words), for `normal` and `uniform` rows of `dim` floats, all `batch` ids.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  import lazy_optax  # pylint: disable=g-import-not-at-top
  from lazy_optax._src import reset_rows as reset_module  # noqa: E501

  words = jnp.asarray(lazy_optax.split_ids(stream[0]))
  key = jax.random.key(0)
  out = {}
  for name, init in (('normal', jax.nn.initializers.normal(0.01)),
                     ('uniform', jax.nn.initializers.uniform(0.01))):
    hashed = jax.jit(lambda w, init=init: reset_module.fresh_rows(
        init, key, w, (args.dim,), jnp.float32, 'table'))

    def threefry_rows(w, init=init):
      keys = jax.vmap(lambda x: jax.random.fold_in(
          jax.random.fold_in(key, x[0]), x[1]))(w)
      return jax.vmap(lambda k: init(k, (args.dim,), jnp.float32))(keys)

    threefry = jax.jit(threefry_rows)
    times = {'hash': [], 'threefry': []}
    for f in (hashed, threefry):
      f(words).block_until_ready()
    for _ in range(max(20, args.steps // 3)):
      for label, f in (('hash', hashed), ('threefry', threefry)):
        t0 = time.perf_counter()
        f(words).block_until_ready()
        times[label].append(time.perf_counter() - t0)
    out[name] = {label: _median_ms(t) for label, t in times.items()}
  return out


def fbgemm(args: argparse.Namespace, stream: np.ndarray) -> dict:
  """Part 3: FBGEMM's CPU `zero_collision_hash` in its own interpreter."""
  python = args.fbgemm_python
  if not python or not os.path.exists(python):
    return {'skipped': f'no FBGEMM interpreter at {python!r}'}
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        'fbgemm_zch_contender.py')
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, 'stream.npy')
    np.save(path, stream)
    cfg = {'stream': path, 'capacity': args.capacity, 'probe': args.probe,
           'fill_steps': args.fill_steps, 'steps': args.steps}
    proc = subprocess.run([python, script, json.dumps(cfg)],
                          capture_output=True, text=True, timeout=3600)
  if proc.returncode != 0:
    return {'failed': proc.stderr[-2000:]}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--capacity', type=int, default=1_000_000)
  parser.add_argument('--dim', type=int, default=64)
  parser.add_argument('--batch', type=int, default=4096)
  parser.add_argument('--universe', type=int, default=10 ** 9)
  parser.add_argument('--zipf', type=float, default=1.05)
  parser.add_argument('--probe', type=int, default=16)
  parser.add_argument('--eviction', choices=('lru', 'lfu', 'none'),
                      default=None, help="IdTable's eviction (default: "
                      "IdTable's default)")
  parser.add_argument('--fill-steps', type=int, default=None,
                      help='steps run before timing (default: until the '
                      'stream has filled the table)')
  parser.add_argument('--steps', type=int, default=300)
  parser.add_argument('--warmup', type=int, default=20)
  parser.add_argument('--fbgemm-python', default=peers.python_for('fbgemm'),
                      help='FBGEMM\'s interpreter (default '
                      '$LAZY_OPTAX_FBGEMM_PYTHON)')
  parser.add_argument('--quick', action='store_true',
                      help='small sizes, for a smoke run')
  parser.add_argument('--skip', default='',
                      help='comma-separated parts to skip: train,assign,'
                      'init,fbgemm')
  args = parser.parse_args(argv)
  if args.quick:
    args.capacity, args.steps, args.warmup = 20_000, 20, 3
    args.universe, args.batch = 10 ** 6, 1024
  if args.fill_steps is None:
    # Enough distinct ids to fill the table twice over (measured: about a
    # fifth of a batch is new once the hot ids are in).
    args.fill_steps = max(10, int(2.5 * args.capacity / (0.2 * args.batch)))
  skip = set(filter(None, args.skip.split(',')))
  stream = zipf_stream(args.universe, args.batch,
                       args.fill_steps + args.steps + args.warmup, args.zipf,
                       seed=0)
  config = {k: v for k, v in vars(args).items() if k != 'skip'}
  print(f'config: {json.dumps(config)}', flush=True)
  out: dict = {'config': config}
  if 'train' not in skip:
    out['train'] = train_steps(args, stream)
    t = out['train']
    print(f"train step: fixed {t['fixed_step_ms']:.3f} ms, hashed "
          f"{t['hashed_step_ms']:.3f} ms, ratio {t['ratio']:.2f}x "
          f"(target <= 1.3x); fresh rows a step {t['fresh_rows_per_step']:.0f}"
          f"; table-sized copies {len(t['table_sized_copies'])}, temporary "
          f"memory {t['temp_bytes']:,} bytes (at twice the capacity "
          f"{t['temp_bytes_2x_capacity']:,})",
          flush=True)
  if 'assign' not in skip:
    out['assign'] = assign_alone(args, stream)
    a = out['assign']
    print(f"IdTable.assign: {a['assign_ms']:.3f} ms, "
          f"{a['assign_ids_per_s'] / 1e6:.2f} M ids/s, own row "
          f"{a['own_row_fraction']:.4f}; find: {a['find_ms']:.3f} ms, "
          f"{a['find_ids_per_s'] / 1e6:.2f} M ids/s", flush=True)
  if 'init' not in skip:
    out['init'] = init_cost(args, stream)
    for name, t in out['init'].items():
      print(f"initial rows of {args.batch} ids x {args.dim} ({name}): hash "
            f"keys {t['hash']:.3f} ms, threefry fold_in {t['threefry']:.3f} "
            'ms', flush=True)
  if 'fbgemm' not in skip:
    out['fbgemm'] = fbgemm(args, stream)
    f = out['fbgemm']
    if 'lookup_ids_per_s' in f:
      print(f"FBGEMM zero_collision_hash (CPU, read-only): "
            f"{f['lookup_ms']:.3f} ms, {f['lookup_ids_per_s'] / 1e6:.2f} M "
            f"ids/s; own row {f['own_row_fraction']:.4f} (insertion as its "
            'CUDA op, on the host)', flush=True)
    else:
      print(f'FBGEMM: {f}', flush=True)
  print(json.dumps(out, default=str))
  if 'train' in out and (out['train']['table_sized_copies'] or
                         out['train']['temp_bytes'] !=
                         out['train']['temp_bytes_2x_capacity']):
    print('FAILED: a table-sized array other than the donated ones is in '
          'the compiled hashed step.', file=sys.stderr)
    sys.exit(1)
  return out


if __name__ == '__main__':
  main()

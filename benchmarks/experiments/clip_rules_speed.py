"""The cost of CowClip and row max-norm in an optimizer step, side by side.

    python3 -m benchmarks.experiments.clip_rules_speed [--steps 60]
        [--shape target|dlrm]

On the target table (`common.TARGET`: 1,000,000 x 64 float32, 4,096 Zipf
ids per batch), or on the 26 DLRM tables (`--shape dlrm`: Criteo Kaggle's
cardinalities capped at 1,000,000, 16 floats a row, 2,048 Zipf ids per
table), each optimizer step (`tx.update` + `apply_updates` on a
row-sparse gradient built inside the step, jitted, donated) is compiled:

* `rowwise_adagrad` (the reference the targets are measured against);
* `rowwise_adagrad+max_norm`: the same chain ending in `row_max_norm`
  (clipped inside `apply_updates`' scatter-add: one kernel);
* `rowwise_adagrad+max_norm_rows`: the same, its update rebuilt from its
  ids and rows before `apply_updates` (the clip as a pass of its own: a
  gather of the parameter rows, the clip's kernel, the scatter-add);
* `lazy_adam`;
* `lazy_adam+cowclip`: `lazy_adam_cowclip`, counts from the batch's ids.

They run interleaved, step by step, each on its own table; the script prints
the median CPU time per step (`time.process_time`, all threads), and each
one's ratio to `rowwise_adagrad` and to its unclipped form.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import cardinalities
from benchmarks.common import DLRM_DEFAULTS
from benchmarks.common import make_batches
from benchmarks.common import TARGET
import lazy_optax


def optimizers(lr: float = 1e-3) -> dict:
  """name -> (tx, whether its update takes counts)."""
  return {
      'rowwise_adagrad': (lazy_optax.rowwise_adagrad(lr), False),
      'rowwise_adagrad+max_norm': (lazy_optax.lazy(optax.chain(
          lazy_optax.scale_by_rowwise_adagrad(),
          optax.scale_by_learning_rate(lr),
          lazy_optax.row_max_norm(1.0))), False),
      'rowwise_adagrad+max_norm_rows': (lazy_optax.lazy(optax.chain(
          lazy_optax.scale_by_rowwise_adagrad(),
          optax.scale_by_learning_rate(lr),
          lazy_optax.row_max_norm(1.0))), False),
      'lazy_adam': (lazy_optax.lazy_adam(lr), False),
      'lazy_adam+cowclip': (lazy_optax.lazy_adam_cowclip(lr), True),
  }


def compiled_step(tx, takes_counts: bool, rebuilt: bool = False):
  """The jitted, donated step on lists of tables, ids and gradient rows."""
  def step(params, state, ids, values):
    grads = [lazy_optax.SparseRows(i, v, p.shape[0])
             for i, v, p in zip(ids, values, params)]
    extra = ({'counts': [lazy_optax.id_counts(i, p.shape[0])
                         for i, p in zip(ids, params)]}
             if takes_counts else {})
    updates, state = tx.update(grads, state, params, **extra)
    if rebuilt:  # the same rows, without the fused add
      updates = [lazy_optax.SparseRows.from_unique(
          u.ids, u.values, u.num_rows, distinct=True) for u in updates]
    return lazy_optax.apply_updates(params, updates), state
  return jax.jit(step, donate_argnums=(0, 1))


def _shapes(which: str) -> tuple[list[tuple[int, int]], int, int]:
  """(rows, width) of each table, ids per table per batch, batches."""
  if which == 'target':
    return [(TARGET['rows'], TARGET['row'])], TARGET['ids'], 8
  cfg = DLRM_DEFAULTS
  return ([(c, cfg['row']) for c in cardinalities(cfg)], cfg['batch'], 4)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--shape', choices=('target', 'dlrm'),
                      default='target',
                      help='the target table, or the 26 DLRM tables '
                      '(Criteo Kaggle capped at 1,000,000, 16 wide, 2,048 '
                      'Zipf ids each)')
  args = parser.parse_args()
  shapes, n_ids, pool = _shapes(args.shape)
  batches = [make_batches({'rows': v, 'ids': n_ids, 'dist': 'zipf',
                           'pool': pool, 'seed': t})
             for t, (v, _) in enumerate(shapes)]
  rng = np.random.default_rng(0)
  values = [jnp.asarray(rng.normal(size=(n_ids, d)) * 1e-2, jnp.float32)
            for _, d in shapes]
  runs = {}
  for name, (tx, takes_counts) in optimizers().items():
    params = [jnp.asarray(rng.normal(size=(v, d)) * 0.1, jnp.float32)
              for v, d in shapes]
    state = tx.init(params)
    step = compiled_step(tx, takes_counts, name.endswith('_rows'))
    text = step.lower(params, state, [jnp.asarray(b[0]) for b in batches],
                      values).compile().as_text()
    kernels = sorted({w.split('"')[0] for w in text.split(
        'custom_call_target="lazy_optax_LazyOptax')[1:]})
    print(f'{name}: kernels {kernels}')
    runs[name] = [step, params, state, []]
  for k in range(args.steps):
    ids = [jnp.asarray(b[k % len(b)]) for b in batches]
    names = list(runs) if k % 2 else list(reversed(runs))
    for name in names:
      run = runs[name]
      c0 = time.process_time()
      run[1], run[2] = run[0](run[1], run[2], ids, values)
      jax.block_until_ready(run[1])
      if k >= 5:  # past compilation and warm-up
        run[3].append(time.process_time() - c0)
  med = {name: 1e3 * float(np.median(run[3])) for name, run in runs.items()}
  base = med['rowwise_adagrad']
  for name, ms in med.items():
    own = med[name.split('+')[0]]
    print(f'{name:30s} {ms:7.3f} ms CPU/step  x{ms / base:.2f} of '
          f'rowwise_adagrad  x{ms / own:.2f} of its unclipped form')


if __name__ == '__main__':
  main()

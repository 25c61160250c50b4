"""The cost of CowClip and row max-norm in an optimizer step, side by side.

    python3 -m benchmarks.experiments.clip_rules_speed [--steps 60]

On the target table (`common.TARGET`: 1,000,000 x 64 float32, 4,096 Zipf
ids per batch), each optimizer step (`tx.update` + `apply_updates` on a
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


def compiled_step(tx, takes_counts: bool, rows: int, rebuilt: bool = False):
  def step(params, state, ids, values):
    grads = {'table': lazy_optax.SparseRows(ids, values, rows)}
    extra = ({'counts': {'table': lazy_optax.id_counts(ids, rows)}}
             if takes_counts else {})
    updates, state = tx.update(grads, state, params, **extra)
    if rebuilt:  # the same rows, without the fused add
      u = updates['table']
      updates = {'table': lazy_optax.SparseRows.from_unique(
          u.ids, u.values, rows, distinct=True)}
    return lazy_optax.apply_updates(params, updates), state
  return jax.jit(step, donate_argnums=(0, 1))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=60)
  args = parser.parse_args()
  cfg = dict(TARGET, pool=8)
  rows, width = cfg['rows'], cfg['row']
  batches = make_batches(cfg)
  rng = np.random.default_rng(0)
  values = jnp.asarray(rng.normal(size=(cfg['ids'], width)) * 1e-2,
                       jnp.float32)
  runs = {}
  for name, (tx, takes_counts) in optimizers().items():
    params = {'table': jnp.asarray(
        rng.normal(size=(rows, width)) * 0.1, jnp.float32)}
    state = tx.init(params)
    step = compiled_step(tx, takes_counts, rows, name.endswith('_rows'))
    text = step.lower(params, state, jnp.asarray(batches[0]),
                      values).compile().as_text()
    kernels = sorted({w.split('"')[0] for w in text.split(
        'custom_call_target="lazy_optax_LazyOptax')[1:]})
    print(f'{name}: kernels {kernels}')
    runs[name] = [step, params, state, []]
  for k in range(args.steps):
    ids = jnp.asarray(batches[k % len(batches)])
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

"""Which part of the hashed step copies the id table, compiled for this backend.

    python3 -m benchmarks.experiments.hashed_step_hlo [--out DIR]

Compiles (runs nothing) the hashed train step of `hashed_table.py` and three
of its parts, each jitted with its state donated, for the default backend:
`IdTable.assign` alone, `assign` + `reset_rows`, and the whole step. For
each it prints the table-sized copies and broadcasts of the compiled module
(arrays of >= capacity rows other than the donated ones are the cost this
looks for) and XLA's temporary memory, and with `--out` writes each
module's text to `DIR/<part>.hlo.txt`. On the CPU none of them copies; on a
GPU the whole step did (4 copies of the slot arrays, measured 2026-11-27).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.experiments.hashed_table import _table_sized_copies
from benchmarks.experiments.hashed_table import hashed_train_step
import lazy_optax


def parts(capacity: int, dim: int, batch: int) -> dict:
  """name -> (function, donated argnums, example arguments)."""
  table = lazy_optax.IdTable(capacity=capacity, eviction_log=0)
  tx = lazy_optax.lazy_adam(1e-3)
  init = jax.nn.initializers.normal(0.01)
  key = jax.random.key(0)
  params = {'table': jax.ShapeDtypeStruct((capacity, dim), jnp.float32),
            'w': jax.ShapeDtypeStruct((dim,), jnp.float32)}
  opt_state = jax.eval_shape(tx.init, params)
  id_state = jax.eval_shape(table.init)
  words = lazy_optax.split_ids(np.arange(batch, dtype=np.int64) * 7919)
  step = jnp.int32(0)

  def assign(id_state, words, step):
    return table.assign(id_state, words, step=step)

  def assign_reset(params, opt_state, id_state, words, step):
    slots, id_state, fresh = table.assign(id_state, words, step=step)
    params, opt_state = lazy_optax.reset_rows(
        tx, params, opt_state, {'table': fresh}, init=init, key=key)
    return params, opt_state, id_state, slots

  return {
      'assign': (assign, (0,), (id_state, words, step)),
      'assign_reset_rows': (assign_reset, (0, 1, 2),
                            (params, opt_state, id_state, words, step)),
      'hashed_step': (hashed_train_step(table, tx, init, key), (0, 1, 2),
                      (params, opt_state, id_state, words, step)),
  }


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--capacity', type=int, default=1_000_000)
  parser.add_argument('--dim', type=int, default=64)
  parser.add_argument('--batch', type=int, default=4096)
  parser.add_argument('--out', default='')
  args = parser.parse_args(argv)
  print(f'backend {jax.default_backend()}, jax {jax.__version__}, capacity '
        f'{args.capacity:,}')
  out = {}
  for name, (fn, donate, example) in parts(
      args.capacity, args.dim, args.batch).items():
    compiled = jax.jit(fn, donate_argnums=donate).lower(*example).compile()
    text = compiled.as_text()
    copies = _table_sized_copies(text, args.capacity)
    memory = compiled.memory_analysis()
    temp = int(memory.temp_size_in_bytes) if memory else -1
    out[name] = {'copies': copies, 'temp_bytes': temp}
    print(f'{name}: {len(copies)} table-sized copies, temporary memory '
          f'{temp:,} bytes')
    for line in copies:
      print(f'  {line}')
    if args.out:
      os.makedirs(args.out, exist_ok=True)
      with open(os.path.join(args.out, f'{name}.hlo.txt'), 'w') as f:
        f.write(text)
  return out


if __name__ == '__main__':
  main()

"""Demo: word vectors trained with lazy_adam and with optax.adam, side by side.

Run `python -m lazy_optax.demo`. It trains a skip-gram model with negative
sampling (two embedding tables) on text that ships with Python (the
docstrings of standard-library modules), once with `lazy_optax.lazy_adam`
on row-sparse gradients and once with `optax.adam` on dense gradients, then
prints the final losses, the median step times and the table size.
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lazy_optax

_MODULES = ('abc', 'argparse', 'asyncio', 'collections', 'contextlib', 'csv',
            'dataclasses', 'datetime', 'decimal', 'email', 'enum',
            'functools', 'heapq', 'http.client', 'inspect', 'io',
            'itertools', 'json', 'logging', 'os', 'pathlib', 'pickle',
            'random', 're', 'shutil', 'socket', 'sqlite3', 'statistics',
            'string', 'subprocess', 'tarfile', 'textwrap', 'threading',
            'typing', 'unittest', 'urllib.parse', 'uuid', 'zipfile')


def stdlib_corpus() -> str:
  """Docstrings of standard-library modules and their public members."""
  texts = []
  warnings.simplefilter('ignore', DeprecationWarning)
  for name in _MODULES:
    module = importlib.import_module(name)
    texts.append(module.__doc__ or '')
    for attr in sorted(dir(module)):
      if not attr.startswith('_'):
        texts.append(getattr(getattr(module, attr), '__doc__', None) or '')
  return '\n'.join(t for t in texts if isinstance(t, str))


def skipgram_pairs(text: str, table_rows: int, window: int = 2):
  """Word ids (hashed into `table_rows` rows) and (center, context) pairs."""
  words = re.findall(r'[a-z]+', text.lower())
  vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
  if len(vocab) > table_rows:
    raise ValueError(f'table of {table_rows} rows is smaller than the '
                     f'vocabulary ({len(vocab)} words)')
  ids = np.array([vocab[w] for w in words], np.int32)
  centers, contexts = [], []
  for k in range(1, window + 1):
    centers += [ids[:-k], ids[k:]]
    contexts += [ids[k:], ids[:-k]]
  return np.concatenate(centers), np.concatenate(contexts), len(vocab)


def _loss_from_rows(rows_in, rows_out, num_pos):
  u = rows_in[:num_pos]
  v_pos = rows_out[:num_pos]
  v_neg = rows_out[num_pos:].reshape(num_pos, -1, u.shape[-1])
  pos = jax.nn.log_sigmoid(jnp.sum(u * v_pos, -1))
  neg = jax.nn.log_sigmoid(-jnp.einsum('bd,bkd->bk', u, v_neg)).sum(-1)
  return -jnp.mean(pos + neg)


def make_steps(tx_lazy, tx_dense, num_pos):
  """Jitted train steps (params and optimizer state donated)."""

  def lazy_step(params, opt_state, center, context, negatives):
    ids_out = jnp.concatenate([context, negatives.reshape(-1)])
    rows_in = params['in'][center]
    rows_out = params['out'][ids_out]
    loss, (g_in, g_out) = jax.value_and_grad(_loss_from_rows, (0, 1))(
        rows_in, rows_out, num_pos)
    grads = {
        'in': lazy_optax.SparseRows(center, g_in, params['in'].shape[0]),
        'out': lazy_optax.SparseRows(ids_out, g_out, params['out'].shape[0]),
    }
    updates, opt_state = tx_lazy.update(grads, opt_state, params)
    return lazy_optax.apply_updates(params, updates), opt_state, loss

  def dense_step(params, opt_state, center, context, negatives):
    def loss_fn(p):
      ids_out = jnp.concatenate([context, negatives.reshape(-1)])
      return _loss_from_rows(p['in'][center], p['out'][ids_out], num_pos)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx_dense.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return (jax.jit(lazy_step, donate_argnums=(0, 1)),
          jax.jit(dense_step, donate_argnums=(0, 1)))


def train(step, tx, centers, contexts, vocab_size, args, seed):
  """Runs `args.steps` steps; returns the losses and step times."""
  key = jax.random.PRNGKey(seed)
  scale = 0.5 / args.dim
  params = {
      'in': jax.random.uniform(key, (args.table_rows, args.dim), jnp.float32,
                               -scale, scale),
      'out': jnp.zeros((args.table_rows, args.dim), jnp.float32),
  }
  opt_state = tx.init(params)
  rng = np.random.default_rng(seed)
  losses, times = [], []
  for _ in range(args.steps):
    pick = rng.integers(0, centers.shape[0], args.batch)
    negatives = rng.integers(0, vocab_size, (args.batch, args.negatives))
    t0 = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, centers[pick],
                                   contexts[pick], negatives.astype(np.int32))
    losses.append(float(loss))
    times.append(time.perf_counter() - t0)
  return losses, times


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--table-rows', type=int, default=200_000)
  parser.add_argument('--dim', type=int, default=32)
  parser.add_argument('--batch', type=int, default=512)
  parser.add_argument('--negatives', type=int, default=4)
  args = parser.parse_args(argv)
  centers, contexts, vocab_size = skipgram_pairs(stdlib_corpus(),
                                                 args.table_rows)
  lazy_step, dense_step = make_steps(
      lazy_optax.lazy_adam(1e-2), optax.adam(1e-2), args.batch)
  results = {}
  for name, step, tx in (('lazy_adam', lazy_step, lazy_optax.lazy_adam(1e-2)),
                         ('optax.adam', dense_step, optax.adam(1e-2))):
    losses, times = train(step, tx, centers, contexts, vocab_size, args, 0)
    results[name] = (np.mean(losses[-20:]), statistics.median(times[1:]))
  print(f'table: {args.table_rows} x {args.dim} (x2 tables), vocabulary '
        f'{vocab_size} words, {centers.shape[0]} skip-gram pairs')
  for name, (loss, t) in results.items():
    print(f'{name:>10}: final loss {loss:.4f}, median step {t * 1e3:.2f} ms')
  speedup = results['optax.adam'][1] / results['lazy_adam'][1]
  print(f'speed-up of lazy_adam over optax.adam: {speedup:.1f}x')


if __name__ == '__main__':
  main()

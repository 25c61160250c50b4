"""Demo: word vectors trained with lazy_adam and with optax.adam, side by side.

Run `python -m lazy_optax.demo` (`--help` lists the options). It trains a
skip-gram model with negative sampling (two embedding tables) on text that
ships with Python (the docstrings of standard-library modules) or on a text
file of your own, once with `lazy_optax.lazy_adam` on row-sparse gradients
from `lazy_optax.value_and_grad` and once with `optax.adam` on the dense
gradients of `jax.value_and_grad`, from the same loss function, then prints
the final loss and median step time of each, the speed-up and the table size.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import statistics
import sys
import time
from typing import Callable, Optional, Sequence, TextIO
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
  """Docstrings of standard-library modules and their public members.

  Returns:
    One string, a few megabytes of English text that ships with Python.

  Example:
    >>> from lazy_optax.demo import stdlib_corpus
    >>> len(stdlib_corpus().split()) > 100_000
    True
  """
  texts = []
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    for name in _MODULES:
      module = importlib.import_module(name)
      texts.append(module.__doc__ or '')
      for attr in sorted(dir(module)):
        if not attr.startswith('_'):
          texts.append(getattr(getattr(module, attr), '__doc__', None) or '')
  return '\n'.join(t for t in texts if isinstance(t, str))


def skipgram_pairs(text: str, table_rows: int, window: int = 2):
  """Word ids and the (center, context) pairs of a skip-gram window.

  Args:
    text: the corpus; words are runs of letters, lowercased.
    table_rows: rows of each embedding table; must hold the vocabulary.
    window: how many words on each side of a center word are its context.

  Returns:
    `(centers, contexts, vocab_size)`: two int32 arrays of word ids, one
    entry per pair, and the number of distinct words.

  Raises:
    ValueError: when the text has fewer than two words, or more distinct
      words than `table_rows`.

  Example:
    >>> from lazy_optax.demo import skipgram_pairs
    >>> centers, contexts, vocab = skipgram_pairs('a b a c', 10, window=1)
    >>> vocab, centers.tolist(), contexts.tolist()
    (3, [0, 1, 0, 1, 0, 2], [1, 0, 2, 0, 1, 0])
  """
  words = re.findall(r'[a-z]+', text.lower())
  if len(words) < 2:
    raise ValueError(
        f'the text holds {len(words)} word(s); the demo needs at least two '
        '(words are runs of the letters a to z).')
  vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
  if len(vocab) > table_rows:
    raise ValueError(
        f'a table of {table_rows} rows is smaller than the vocabulary '
        f'({len(vocab)} words): raise --table-rows.')
  ids = np.array([vocab[w] for w in words], np.int32)
  centers, contexts = [], []
  for k in range(1, window + 1):
    centers += [ids[:-k], ids[k:]]
    contexts += [ids[k:], ids[:-k]]
  return np.concatenate(centers), np.concatenate(contexts), len(vocab)


def skipgram_loss(params, center, context, negatives):
  """Negative-sampling loss of a batch; tables read via `lazy_optax.lookup`.

  Under `jax.value_and_grad` the tables' gradients are dense; under
  `lazy_optax.value_and_grad` they are `SparseRows` of the looked-up rows.

  Args:
    params: `{'in': [V, D], 'out': [V, D]}` embedding tables.
    center: `[B]` center word ids.
    context: `[B]` context word ids.
    negatives: `[B, K]` ids of sampled negative words.

  Returns:
    The mean loss over the batch (a scalar).
  """
  u = lazy_optax.lookup(params['in'], center)                 # [B, D]
  v_pos = lazy_optax.lookup(params['out'], context)           # [B, D]
  v_neg = lazy_optax.lookup(params['out'], negatives)         # [B, K, D]
  pos = jax.nn.log_sigmoid(jnp.sum(u * v_pos, -1))
  neg = jax.nn.log_sigmoid(-jnp.einsum('bd,bkd->bk', u, v_neg)).sum(-1)
  return -jnp.mean(pos + neg)


def make_step(tx: optax.GradientTransformation, sparse: bool) -> Callable:
  """A jitted train step (params and optimizer state donated).

  Args:
    tx: the optimizer.
    sparse: differentiate with `lazy_optax.value_and_grad` (row-sparse
      table gradients) rather than `jax.value_and_grad` (dense).

  Returns:
    `step(params, opt_state, center, context, negatives)` returning
    `(params, opt_state, loss)`.
  """
  grad_fn = (lazy_optax.value_and_grad if sparse else jax.value_and_grad)(
      skipgram_loss)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, center, context, negatives):
    loss, grads = grad_fn(params, center, context, negatives)
    updates, opt_state = tx.update(grads, opt_state, params)
    return lazy_optax.apply_updates(params, updates), opt_state, loss

  return step


class Progress:
  """A one-line text progress bar (no dependencies), written to a stream."""

  def __init__(self, total: int, label: str, stream: TextIO = sys.stderr,
               width: int = 30):
    self.total, self.label = total, label
    self.stream, self.width = stream, width
    self.start = time.perf_counter()

  def update(self, done: int, loss: float) -> None:
    filled = self.width * done // self.total
    bar = '#' * filled + '.' * (self.width - filled)
    elapsed = time.perf_counter() - self.start
    self.stream.write(f'\r{self.label:<11} [{bar}] {done}/{self.total} '
                      f'loss {loss:.4f} {elapsed:5.1f}s')
    if done == self.total:
      self.stream.write('\n')
    self.stream.flush()


def train(step: Callable, tx: optax.GradientTransformation,
          centers: np.ndarray, contexts: np.ndarray, vocab_size: int,
          args: argparse.Namespace, label: str, stream: TextIO):
  """Runs `args.steps` steps from a fixed seed.

  Returns:
    `(losses, times)`: the loss and the wall time (seconds) of each step.
  """
  key = jax.random.key(args.seed)
  scale = 0.5 / args.dim
  params = {
      'in': jax.random.uniform(key, (args.table_rows, args.dim), jnp.float32,
                               -scale, scale),
      'out': jnp.zeros((args.table_rows, args.dim), jnp.float32),
  }
  opt_state = tx.init(params)
  rng = np.random.default_rng(args.seed)
  progress = Progress(args.steps, label, stream)
  every = max(1, args.steps // 50)
  losses, times = [], []
  for i in range(args.steps):
    pick = rng.integers(0, centers.shape[0], args.batch)
    negatives = rng.integers(0, vocab_size, (args.batch, args.negatives),
                             dtype=np.int32)
    t0 = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, centers[pick],
                                   contexts[pick], negatives)
    loss = float(loss)   # waits for the step to finish
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    if (i + 1) % every == 0 or i + 1 == args.steps:
      progress.update(i + 1, loss)
  return losses, times


def _positive(name: str) -> Callable[[str], int]:
  def parse(text: str) -> int:
    try:
      value = int(text.replace('_', ''))
    except ValueError:
      raise argparse.ArgumentTypeError(
          f'{name} must be a whole number, got {text!r}') from None
    if value <= 0:
      raise argparse.ArgumentTypeError(f'{name} must be positive, got {value}')
    return value
  return parse


def _positive_float(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
        f'the learning rate must be a number, got {text!r}') from None
  if not value > 0 or value == float('inf'):
    raise argparse.ArgumentTypeError(
        f'the learning rate must be positive and finite, got {text}')
  return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
  """The demo's command line (see `--help`)."""
  parser = argparse.ArgumentParser(
      prog='python -m lazy_optax.demo',
      description=__doc__.split('\n\n')[0])
  for flag, default, what in (
      ('--steps', 150, 'train steps of each optimizer'),
      ('--table-rows', 200_000, 'rows of each of the two embedding tables; '
       'must hold the vocabulary'),
      ('--dim', 32, 'embedding size'),
      ('--batch', 512, 'skip-gram pairs per step'),
      ('--negatives', 4, 'negative words per pair')):
    parser.add_argument(flag, type=_positive(flag), default=default,
                        help=f'{what} (default {default})')
  parser.add_argument('--lr', type=_positive_float, default=1e-2,
                      help='learning rate of both optimizers (default 0.01)')
  parser.add_argument('--text', metavar='FILE', default=None,
                      help='a UTF-8 text file to train on instead of the '
                      "standard library's docstrings")
  parser.add_argument('--seed', type=int, default=0, help='random seed')
  args = parser.parse_args(argv)
  if args.text is not None:
    try:
      with open(args.text, encoding='utf-8') as f:
        args.corpus = f.read()
    except UnicodeDecodeError as e:
      parser.error(f'cannot read --text {args.text!r}: not UTF-8 text ({e})')
    except OSError as e:
      parser.error(f'cannot read --text {args.text!r}: '
                   f'{e.strerror or e}')
    args.corpus_name = args.text
  else:
    args.corpus = None
    args.corpus_name = "Python standard-library docstrings"
  if args.table_rows * args.dim * 4 > 2 ** 31:
    parser.error(f'--table-rows {args.table_rows} x --dim {args.dim} makes '
                 'tables over 2 GiB each; the demo keeps to smaller ones')
  try:
    text = stdlib_corpus() if args.corpus is None else args.corpus
    args.pairs = skipgram_pairs(text, args.table_rows)
  except ValueError as e:
    parser.error(f'{args.corpus_name}: {e}')
  return args


def main(argv: Optional[Sequence[str]] = None, stream: TextIO = sys.stdout,
         progress: TextIO = sys.stderr) -> dict[str, dict[str, float]]:
  """Runs the demo and prints its table.

  Args:
    argv: command-line arguments (default: `sys.argv[1:]`).
    stream: where the table is printed.
    progress: where the progress bars are drawn.

  Returns:
    `{name: {'loss': final loss, 'step_ms': median step time}}` for
    `'lazy_adam'` and `'optax.adam'`.
  """
  args = parse_args(argv)
  centers, contexts, vocab_size = args.pairs
  runs = (('lazy_adam', 'row-sparse', lazy_optax.lazy_adam(args.lr), True),
          ('optax.adam', 'dense', optax.adam(args.lr), False))
  results = {}
  for name, _, tx, sparse in runs:
    losses, times = train(make_step(tx, sparse), tx, centers, contexts,
                          vocab_size, args, name, progress)
    tail = max(1, min(20, len(losses) // 5))
    results[name] = {
        'loss': float(np.mean(losses[-tail:])),
        # The first step compiles; leave it out where there are others.
        'step_ms': 1e3 * statistics.median(times[1:] or times),
    }
  mib = 2 * args.table_rows * args.dim * 4 / 2 ** 20
  lines = [
      '',
      f'corpus: {args.corpus_name}: {vocab_size} distinct words, '
      f'{centers.shape[0]} skip-gram pairs',
      f'tables: 2 x {args.table_rows:,} rows x {args.dim} float32 '
      f'({mib:.1f} MiB); {args.steps} steps of {args.batch} pairs '
      f'with {args.negatives} negatives each',
      '',
      f'{"optimizer":<12}{"gradients":<12}{"final loss":>12}'
      f'{"median step":>14}',
  ]
  for name, kind, _, _ in runs:
    r = results[name]
    lines.append(f'{name:<12}{kind:<12}{r["loss"]:>12.4f}'
                 f'{r["step_ms"]:>11.2f} ms')
  speedup = results['optax.adam']['step_ms'] / results['lazy_adam']['step_ms']
  lines.append(f'speed-up of lazy_adam over optax.adam: {speedup:.1f}x '
               '(final loss: mean of the last steps)')
  print('\n'.join(lines), file=stream)
  return results


if __name__ == '__main__':
  main()

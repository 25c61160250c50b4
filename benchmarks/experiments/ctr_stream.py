"""A synthetic click-through-rate stream for the optimizer experiments.

Shared by the experiments that compare embedding optimizers on CTR data
(`python3 -m benchmarks.experiments.NAME`): a planted factorization-machine
model over `fields` categorical fields whose ids follow a Zipf law, so most
ids are rare and a few are frequent, as in ads and recommendation logs.

* `make_split(...)` draws the samples once (ids and clicks) and splits them
  into a training and a held-out part.
* `FactorizationMachine` is the model trained on it: a bias per id (column 0
  of the one table), an embedding per id (the other columns), pairwise dot
  products between fields, a dense global bias.
* `train(tx, split, ...)` trains any optax transformation built by
  lazy_optax (jitted, donated, row-sparse gradients through
  `lazy_optax.value_and_grad`) and returns the held-out loss after each
  epoch; `held_out_loss` and `rare_rows_mask` evaluate on all held-out
  samples or on those that hold a rare id.
* `compare_on_tail(contenders, samples)` trains each optimizer on one split
  and reports every held-out sample and the tail (samples holding an id
  seen at most twice); `plot_epochs` draws those curves.
* `add_output_args` and `write_outputs` give each experiment its `--json`
  and `--plot` outputs; `figure` and `save_figure` frame a plot
  (matplotlib, an extra, imported only when a plot is asked for).

Smoke run (prints one epoch of `lazy_adam`):

    python3 -m benchmarks.experiments.ctr_stream
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable, Iterator, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lazy_optax


class Samples(NamedTuple):
  """Examples: `ids` [n, fields] int32 rows of the one table, `clicks` [n]."""
  ids: np.ndarray
  clicks: np.ndarray

  def __len__(self) -> int:
    return len(self.clicks)


class Split(NamedTuple):
  """Training and held-out samples over one table of `num_rows` rows."""
  train: Samples
  test: Samples
  num_rows: int
  fields: int


def _zipf_ranks(rng: np.random.Generator, n: int, vocab: int,
                exponent: float) -> np.ndarray:
  """`n` ranks in [0, vocab), P(rank r) proportional to (r + 1)^-exponent."""
  p = np.arange(1, vocab + 1, dtype=np.float64) ** -exponent
  cdf = np.cumsum(p / p.sum())
  return np.minimum(np.searchsorted(cdf, rng.random(n)), vocab - 1)


def make_split(samples: int = 300_000, *, fields: int = 8,
               vocab: int = 50_000, exponent: float = 1.1,
               planted_dim: int = 4, planted_scale: float = 0.6,
               click_rate: float = 0.25, held_out: float = 0.2,
               seed: int = 0) -> Split:
  """Draws a CTR data set from a planted factorization machine.

  Field `f`'s ids are Zipf(`exponent`) ranks over `vocab` values, shuffled
  so that frequency does not follow the row number, stored as rows
  `f * vocab + rank` of one table. Each id has a planted bias and a planted
  `planted_dim`-vector; the click probability of a sample is the sigmoid of
  the sum of its ids' biases and the pairwise dot products of their vectors,
  plus a global offset that puts the expected click rate at `click_rate`.

  Args:
    samples: number of samples, training and held-out together.
    fields: number of categorical fields.
    vocab: distinct ids per field.
    exponent: the Zipf exponent (larger: a heavier head).
    planted_dim: dimension of the planted vectors.
    planted_scale: standard deviation of planted biases and vector entries.
    click_rate: the expected fraction of clicks.
    held_out: fraction of samples held out (the last ones drawn).
    seed: random seed.

  Returns:
    A `Split` with `num_rows = fields * vocab`.

  Example:
    >>> split = make_split(2_000, fields=3, vocab=100)
    >>> split.train.ids.shape, split.num_rows
    ((1600, 3), 300)
  """
  rng = np.random.default_rng(seed)
  num_rows = fields * vocab
  ids = np.empty((samples, fields), np.int32)
  for f in range(fields):
    shuffle = rng.permutation(vocab)
    ids[:, f] = f * vocab + shuffle[_zipf_ranks(rng, samples, vocab,
                                                exponent)]
  bias = rng.normal(0, planted_scale, num_rows)
  vecs = rng.normal(0, planted_scale, (num_rows, planted_dim))
  logit = bias[ids].sum(1)
  v = vecs[ids]                              # [n, fields, k]
  s = v.sum(1)
  logit += 0.5 * ((s * s).sum(1) - (v * v).sum((1, 2)))
  logit += _offset(logit, click_rate)
  clicks = (rng.random(samples) < 1 / (1 + np.exp(-logit))).astype(
      np.float32)
  cut = int(samples * (1 - held_out))
  return Split(Samples(ids[:cut], clicks[:cut]),
               Samples(ids[cut:], clicks[cut:]), num_rows, fields)


def _offset(logit: np.ndarray, rate: float) -> float:
  """The shift `c` with mean(sigmoid(logit + c)) = rate (bisection)."""
  lo, hi = -50.0, 50.0
  for _ in range(60):
    mid = (lo + hi) / 2
    if np.mean(1 / (1 + np.exp(-(logit + mid)))) < rate:
      lo = mid
    else:
      hi = mid
  return (lo + hi) / 2


class FactorizationMachine(NamedTuple):
  """The trained model: `table` [num_rows, 1 + dim] (bias, embedding), and a
  dense global `bias`."""
  dim: int = 8
  init_scale: float = 0.01

  def init(self, num_rows: int, seed: int = 0) -> dict:
    """Parameters: `{'table': [num_rows, 1 + dim], 'bias': []}`."""
    table = jax.random.normal(jax.random.PRNGKey(seed),
                              (num_rows, 1 + self.dim)) * self.init_scale
    return {'table': table.at[:, 0].set(0.0), 'bias': jnp.zeros([])}

  def logits(self, params: dict, ids: jax.Array) -> jax.Array:
    """Logits of a batch of `ids` [batch, fields]."""
    rows = lazy_optax.lookup(params['table'], ids)   # [batch, fields, 1+dim]
    v = rows[..., 1:]
    s = v.sum(1)
    pairs = 0.5 * ((s * s).sum(-1) - (v * v).sum((-1, -2)))
    return params['bias'] + rows[..., 0].sum(-1) + pairs

  def loss(self, params: dict, ids: jax.Array, clicks: jax.Array
           ) -> jax.Array:
    """Mean binary cross-entropy of a batch."""
    return optax.sigmoid_binary_cross_entropy(
        self.logits(params, ids), clicks).mean()


def batches(samples: Samples, batch_size: int, seed: int
            ) -> Iterator[Samples]:
  """One shuffled epoch in full batches (the last partial batch dropped)."""
  order = np.random.default_rng(seed).permutation(len(samples))
  for start in range(0, len(order) - batch_size + 1, batch_size):
    take = order[start:start + batch_size]
    yield Samples(samples.ids[take], samples.clicks[take])


def held_out_loss(model: FactorizationMachine, params: dict,
                  samples: Samples, mask: Optional[np.ndarray] = None,
                  chunk: int = 8192) -> float:
  """Mean cross-entropy over `samples` (those where `mask` is True)."""
  per_sample = jax.jit(lambda p, i, c: optax.sigmoid_binary_cross_entropy(
      model.logits(p, i), c))
  losses = np.concatenate([
      np.asarray(per_sample(params, samples.ids[s:s + chunk],
                            samples.clicks[s:s + chunk]))
      for s in range(0, len(samples), chunk)])
  return float(losses[mask].mean() if mask is not None else losses.mean())


def rare_rows_mask(split: Split, max_count: int) -> np.ndarray:
  """Held-out samples holding at least one id seen at most `max_count` times
  in training (the tail)."""
  counts = np.bincount(split.train.ids.ravel(), minlength=split.num_rows)
  return (counts[split.test.ids] <= max_count).any(axis=1)


ExtraArgs = Callable[[np.ndarray], dict]
Metric = Callable[[dict], float]


def train(tx: optax.GradientTransformation, split: Split, *,
          batch_size: int = 1024, epochs: int = 3,
          model: Optional[FactorizationMachine] = None,
          extra_args: Optional[ExtraArgs] = None,
          masks: Optional[dict] = None,
          metrics: Optional[dict[str, Metric]] = None, seed: int = 0) -> dict:
  """Trains `model` with `tx`; held-out losses after each epoch.

  Args:
    tx: the optimizer, e.g. `lazy_optax.lazy_adam(1e-3)`.
    split: the data (`make_split`).
    batch_size: samples per step.
    epochs: passes over the training samples.
    model: the model to train (default `FactorizationMachine()`).
    extra_args: `ids -> dict` of keyword arguments for `tx.update` (for
      transformations that take extra arguments), or None.
    masks: `{name: bool mask over split.test}`: also report the held-out loss
      of those samples (e.g. `rare_rows_mask`).
    metrics: `{name: params -> float}`: also report these after each epoch.
    seed: seed of the initialization and of the batch order.

  Returns:
    `{'all': [loss after epoch 1, ...], name: [...] per mask and metric,
    'seconds': s}`.
  """
  model = model or FactorizationMachine()
  params = model.init(split.num_rows, seed)
  state = tx.init(params)
  grad_fn = lazy_optax.value_and_grad(model.loss)

  def step(params, state, ids, clicks, extra):
    _, grads = grad_fn(params, ids, clicks)
    updates, state = tx.update(grads, state, params, **extra)
    return lazy_optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  out: dict[str, Any] = {'all': []}
  out.update({name: [] for name in {**(masks or {}), **(metrics or {})}})
  start = time.perf_counter()
  for epoch in range(epochs):
    for batch in batches(split.train, batch_size, seed * 1000 + epoch):
      extra = extra_args(batch.ids) if extra_args else {}
      params, state = step(params, state, batch.ids, batch.clicks, extra)
    out['all'].append(held_out_loss(model, params, split.test))
    for name, mask in (masks or {}).items():
      out[name].append(held_out_loss(model, params, split.test, mask))
    for name, metric in (metrics or {}).items():
      out[name].append(metric(params))
  out['seconds'] = time.perf_counter() - start
  return out


def compare_on_tail(contenders: dict[str, optax.GradientTransformation],
                    samples: int, *, epochs: int, batch_size: int = 1024,
                    tail_count: int = 2) -> dict:
  """Trains each contender on one split (same data, initialization, order).

  Args:
    contenders: `{name: optimizer}`.
    samples: samples of the split (`make_split`), training and held-out.
    epochs: passes over the training samples.
    batch_size: samples per step.
    tail_count: the tail is the held-out samples holding an id seen at most
      this many times in training.

  Returns:
    `{'samples', 'rows', 'tail_count', 'tail_fraction', 'runs': {name:
    train(...) with a 'tail' entry}}`; one line a contender is printed.
  """
  split = make_split(samples)
  tail = rare_rows_mask(split, tail_count)
  results: dict[str, Any] = {
      'samples': samples, 'rows': split.num_rows, 'tail_count': tail_count,
      'tail_fraction': float(tail.mean()), 'runs': {}}
  for name, tx in contenders.items():
    r = train(tx, split, batch_size=batch_size, epochs=epochs,
              masks={'tail': tail})
    results['runs'][name] = r
    print(f"{name:28s} held-out {' '.join(f'{x:.4f}' for x in r['all'])}  "
          f"tail {' '.join(f'{x:.4f}' for x in r['tail'])}  "
          f"({r['seconds']:.1f} s)", flush=True)
  return results


def figure(width: float = 10.0, height: float = 4.0) -> tuple[Any, Any]:
  """A figure of two panels side by side (matplotlib on Agg)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt.subplots(1, 2, figsize=(width, height))


def save_figure(fig: Any, axes: Any, path: str, legend_size: int = 8
                ) -> None:
  """Legend in the first panel, tight layout, written to `path`."""
  axes[0].legend(fontsize=legend_size)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def plot_epochs(results: dict, path: str) -> None:
  """`compare_on_tail`'s held-out loss per epoch, all samples and the tail,
  one line a contender."""
  fig, axes = figure()
  tail_title = (f"tail: an id seen <= {results['tail_count']}x "
                f"({results['tail_fraction']:.0%} of samples)")
  for ax, key, title in ((axes[0], 'all', 'all held-out samples'),
                         (axes[1], 'tail', tail_title)):
    for name, r in results['runs'].items():
      epochs = range(1, len(r[key]) + 1)
      ax.plot(epochs, r[key], marker='o', label=name)
      ax.set_xticks(epochs)
    ax.set_xlabel('epoch')
    ax.set_ylabel('held-out log loss')
    ax.set_title(title)
  save_figure(fig, axes, path)


def add_output_args(parser: argparse.ArgumentParser) -> None:
  """`--json PATH` and `--plot PATH` (a .png), both optional."""
  parser.add_argument('--json', default=None, help='a .json to write')
  parser.add_argument('--plot', default=None, help='a .png to draw')


def write_outputs(results: dict, args: argparse.Namespace,
                  plot: Callable[[dict, str], None]) -> None:
  """Writes `results` to `args.json` and `plot(results, args.plot)`, each
  where asked for (`add_output_args`)."""
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(results, f, indent=1)
  if args.plot:
    plot(results, args.plot)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--samples', type=int, default=100_000)
  args = parser.parse_args()
  split = make_split(args.samples)
  tail = rare_rows_mask(split, 2)
  result = train(lazy_optax.lazy_adam(1e-3), split, epochs=1,
                 masks={'tail': tail})
  print(f'{len(split.train)} training samples, {split.num_rows} rows, '
        f'click rate {split.train.clicks.mean():.3f}, '
        f'{tail.mean():.1%} of held-out samples hold a rare id')
  print('lazy_adam, 1 epoch:', result)


if __name__ == '__main__':
  main()

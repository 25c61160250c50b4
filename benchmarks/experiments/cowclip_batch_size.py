"""CowClip against unclipped lazy Adam as the batch size grows, on CTR data.

    python3 -m benchmarks.experiments.cowclip_batch_size [--plot out.png]

The shared synthetic stream (`ctr_stream`: a planted factorization machine,
Zipf ids per field) is trained for a fixed number of epochs at batch sizes
of 10^3, 10^4 and 10^5, so a larger batch takes proportionally fewer steps.
The learning rate follows each method's scaling rule, with `s` the batch
size over 1,000:

* `adam_sqrt`: `lazy_adam(lr0 * sqrt(s))`, the square-root rule for Adam;
* `adam_fixed`: `lazy_adam(lr0)`, no scaling;
* `cowclip_fixed r=R`: `lazy_adam_cowclip(lr0, coef=R)`, the paper's rule
  for the embeddings (learning rate unchanged; the paper also scales an L2
  term on the embeddings linearly with `s`, which this model does not have);
* `cowclip_sqrt r=R`: `lazy_adam_cowclip(lr0 * sqrt(s), coef=R)`,

for each CowClip ratio `R` of `--coefs` (`lower_bound` 1e-5). The loss is a
mean over the batch, so a row's gradient per occurrence is about `0.5 / B`
for batch size `B`: a ratio clips only where `R * ||w_r||` falls below that.

CowClip's counts come from each batch's ids (`lazy_optax.id_counts`, built
inside the jitted step). Printed per method and batch size: the held-out
loss and AUC after the last epoch, and the seconds. With `--plot` a figure of
held-out loss against batch size is written (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

import jax
import numpy as np
import optax

from benchmarks.experiments import ctr_stream
import lazy_optax

BATCH_SIZES = (1_000, 10_000, 100_000)


def with_batch_counts(tx: optax.GradientTransformation, num_rows: int
                      ) -> optax.GradientTransformationExtraArgs:
  """`tx` whose update takes the batch's ids and hands CowClip their counts
  (`update(grads, state, params, batch_ids=ids)`)."""

  def update(grads, state, params=None, *, batch_ids, **extra):
    counts = {'table': lazy_optax.id_counts(batch_ids, num_rows),
              'bias': None}
    return tx.update(grads, state, params, counts=counts, **extra)

  return optax.GradientTransformationExtraArgs(tx.init, update)


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """Area under the ROC curve (Mann-Whitney, ties averaged)."""
  order = np.argsort(scores, kind='stable')
  ranks = np.empty(len(scores))
  sorted_scores = scores[order]
  _, first, counts = np.unique(sorted_scores, return_index=True,
                               return_counts=True)
  mean_rank = first + (counts + 1) / 2.0
  ranks[order] = np.repeat(mean_rank, counts)
  pos = labels > 0.5
  n_pos, n_neg = pos.sum(), (~pos).sum()
  return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def held_out_auc(model: ctr_stream.FactorizationMachine, params: dict,
                 samples: ctr_stream.Samples, chunk: int = 65536) -> float:
  logits = jax.jit(model.logits)
  scores = np.concatenate([np.asarray(logits(params, samples.ids[s:s + chunk]))
                           for s in range(0, len(samples), chunk)])
  return auc(scores, samples.clicks)


def methods(lr0: float, num_rows: int, coefs: tuple[float, ...]
            ) -> dict[str, Callable[[float], tuple[Any, bool]]]:
  """name -> (scale s -> (tx, takes batch ids))."""
  def cowclip(lr, coef):
    return with_batch_counts(lazy_optax.lazy_adam_cowclip(lr, coef),
                             num_rows), True

  out: dict[str, Callable[[float], tuple[Any, bool]]] = {
      'adam_sqrt': lambda s: (lazy_optax.lazy_adam(lr0 * np.sqrt(s)), False),
      'adam_fixed': lambda s: (lazy_optax.lazy_adam(lr0), False),
  }
  for coef in coefs:
    out[f'cowclip_fixed r={coef:g}'] = (
        lambda s, coef=coef: cowclip(lr0, coef))
    out[f'cowclip_sqrt r={coef:g}'] = (
        lambda s, coef=coef: cowclip(lr0 * np.sqrt(s), coef))
  return out


def run(samples: int, epochs: int, lr0: float,
        coefs: tuple[float, ...]) -> dict:
  """`{'METHOD BATCH': {method, batch, loss, auc, cpu_s}}` after the last
  epoch; one JSON line is printed a run."""
  split = ctr_stream.make_split(samples)
  model = ctr_stream.FactorizationMachine()
  metrics = {'auc': lambda params: held_out_auc(model, params, split.test)}
  out: dict = {}
  for name, make in methods(lr0, split.num_rows, coefs).items():
    for batch in BATCH_SIZES:
      tx, takes_ids = make(batch / BATCH_SIZES[0])
      start = time.process_time()
      got = ctr_stream.train(
          tx, split, batch_size=batch, epochs=epochs, model=model,
          extra_args=_batch_ids if takes_ids else None, metrics=metrics)
      out[f'{name} {batch}'] = dict(
          method=name, batch=batch, loss=got['all'][-1], auc=got['auc'][-1],
          cpu_s=time.process_time() - start)
      print(json.dumps(out[f'{name} {batch}']), flush=True)
  return out


def _batch_ids(ids: np.ndarray) -> dict:
  """The extra argument of `with_batch_counts`'s update."""
  return {'batch_ids': ids}


def plot(results: dict, path: str) -> None:
  """Held-out loss and AUC against batch size, one line a method."""
  fig, axes = ctr_stream.figure(11, 4.5)
  names = sorted({r['method'] for r in results.values()})
  for name in names:
    rows = [r for r in results.values() if r['method'] == name]
    rows.sort(key=lambda r: r['batch'])
    for ax, key in zip(axes, ('loss', 'auc')):
      ax.plot([r['batch'] for r in rows], [r[key] for r in rows], 'o-',
              label=name)
  for ax, key in zip(axes, ('held-out loss', 'held-out AUC')):
    ax.set_xscale('log')
    ax.set_xlabel('batch size (fixed epochs)')
    ax.set_ylabel(key)
    ax.grid(True, alpha=0.3)
  ctr_stream.save_figure(fig, axes, path, legend_size=7)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--samples', type=int, default=1_000_000)
  parser.add_argument('--epochs', type=int, default=2)
  parser.add_argument('--lr0', type=float, default=2e-3)
  parser.add_argument('--coefs', default='1,0.01,0.0001',
                      help="CowClip's ratios r, comma-separated")
  ctr_stream.add_output_args(parser)
  args = parser.parse_args()
  results = run(args.samples, args.epochs, args.lr0,
                tuple(float(c) for c in args.coefs.split(',')))
  ctr_stream.write_outputs(results, args, plot)


if __name__ == '__main__':
  main()

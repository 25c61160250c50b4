"""Adaptive regularization against one-epoch overfitting, on a CTR stream.

    python3 -m benchmarks.experiments.adaptive_regularization
    python3 -m benchmarks.experiments.adaptive_regularization --plot ar.png

Rare ids overfit in the first epoch: a second pass over the same samples
makes the held-out loss worse. `rowwise_rmsprop_ar` (FBGEMM's
ROWWISE_RMSPROP_AR) shrinks a row at each update by an amount that grows
with the steps since its last one, which is meant to hold rare rows back.
This script trains the factorization machine of `ctr_stream.py` on its
synthetic stream (Zipf ids over 8 fields, a held-out split) for 3 epochs
with:

- `rowwise_rmsprop_ar` at several `ar_alpha` values (the rule),
- the same with `ar_alpha=0` (plain row-wise RMSprop: the control),
- `rowwise_adagrad` (the usual row-wise rule),

and prints the held-out loss after epochs 1, 2 and 3, on every held-out
sample and on those holding an id seen at most twice in training (the
tail). Every run has the same data, initialization and batch order. With
`--plot PATH` it draws the curves (matplotlib, an extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.experiments import ctr_stream
import lazy_optax


def optimizers(lr_rms: float, lr_adagrad: float,
               alphas: tuple[float, ...]) -> dict:
  """name -> optimizer."""
  out = {'rmsprop (ar_alpha=0)': lazy_optax.rowwise_rmsprop_ar(
      lr_rms, ar_alpha=0.0)}
  for a in alphas:
    out[f'rmsprop_ar (ar_alpha={a:g})'] = lazy_optax.rowwise_rmsprop_ar(
        lr_rms, ar_alpha=a)
  out['rowwise_adagrad'] = lazy_optax.rowwise_adagrad(lr_adagrad)
  return out


def run(samples: int, epochs: int, lr_rms: float, lr_adagrad: float,
        alphas: tuple[float, ...], batch_size: int) -> dict:
  """{name: {'all': [...], 'tail': [...], 'seconds': s}}."""
  split = ctr_stream.make_split(samples)
  tail = ctr_stream.rare_rows_mask(split, 2)
  results = {'samples': samples, 'rows': split.num_rows,
             'tail_fraction': float(tail.mean()), 'runs': {}}
  for name, tx in optimizers(lr_rms, lr_adagrad, alphas).items():
    r = ctr_stream.train(tx, split, batch_size=batch_size, epochs=epochs,
                         masks={'tail': tail})
    results['runs'][name] = r
    print(f"{name:28s} held-out {' '.join(f'{x:.4f}' for x in r['all'])}  "
          f"tail {' '.join(f'{x:.4f}' for x in r['tail'])}  "
          f"({r['seconds']:.0f} s)")
    sys.stdout.flush()
  return results


def plot(results: dict, path: str) -> None:
  """Held-out loss per epoch, all samples and the tail, one line a run."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for ax, key, title in ((axes[0], 'all', 'all held-out samples'),
                         (axes[1], 'tail', 'samples with an id seen <= 2x')):
    for name, r in results['runs'].items():
      ax.plot(range(1, len(r[key]) + 1), r[key], marker='o', label=name)
    ax.set_xlabel('epoch')
    ax.set_ylabel('held-out log loss')
    ax.set_title(title)
    ax.set_xticks(range(1, len(r[key]) + 1))
  axes[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--samples', type=int, default=200_000)
  parser.add_argument('--epochs', type=int, default=3)
  parser.add_argument('--batch-size', type=int, default=1024)
  parser.add_argument('--lr-rms', type=float, default=0.01)
  parser.add_argument('--lr-adagrad', type=float, default=0.05)
  parser.add_argument('--alphas', default='0.1,1,10')
  parser.add_argument('--plot', default=None)
  parser.add_argument('--json', default=None)
  args = parser.parse_args()
  start = time.perf_counter()
  results = run(args.samples, args.epochs, args.lr_rms, args.lr_adagrad,
                tuple(float(a) for a in args.alphas.split(',') if a),
                args.batch_size)
  print(f"{results['rows']} rows, {results['tail_fraction']:.1%} of held-out "
        f'samples hold an id seen at most twice; '
        f'{time.perf_counter() - start:.0f} s in all')
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(results, f, indent=1)
  if args.plot:
    plot(results, args.plot)


if __name__ == '__main__':
  main()

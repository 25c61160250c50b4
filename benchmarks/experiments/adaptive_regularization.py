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
  """`ctr_stream.compare_on_tail` of the optimizers."""
  return ctr_stream.compare_on_tail(
      optimizers(lr_rms, lr_adagrad, alphas), samples, epochs=epochs,
      batch_size=batch_size)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--samples', type=int, default=200_000)
  parser.add_argument('--epochs', type=int, default=3)
  parser.add_argument('--batch-size', type=int, default=1024)
  parser.add_argument('--lr-rms', type=float, default=0.01)
  parser.add_argument('--lr-adagrad', type=float, default=0.05)
  parser.add_argument('--alphas', default='0.1,1,10')
  ctr_stream.add_output_args(parser)
  args = parser.parse_args()
  start = time.perf_counter()
  results = run(args.samples, args.epochs, args.lr_rms, args.lr_adagrad,
                tuple(float(a) for a in args.alphas.split(',') if a),
                args.batch_size)
  print(f"{results['rows']} rows, {results['tail_fraction']:.1%} of held-out "
        f'samples hold an id seen at most twice; '
        f'{time.perf_counter() - start:.0f} s in all')
  ctr_stream.write_outputs(results, args, ctr_stream.plot_epochs)


if __name__ == '__main__':
  main()

"""Counter-based learning rates against constant ones, on the tail rows.

    python3 -m benchmarks.experiments.counter_rates [--plot counter_rates.png]

The committed run (defaults, about 15 s on a shared 2-core machine):

    python3 -m benchmarks.experiments.counter_rates \\
        --json benchmarks/results/counter_rates/results.json \\
        --plot benchmarks/results/counter_rates/held_out_loss.png

Trains the shared factorization machine (`ctr_stream`: Zipf ids, a planted
model) with row-wise Adagrad on the table and Adam on the dense bias, the
table's rule being one of:

* `rowwise_adagrad`: the constant-rate baseline;
* `rowwise_adagrad_with_counter` with FBGEMM's counter-based rates:
  `tail_id_lr_increase` (rows seen less often than the most frequent get up
  to 10x the step, `(max_counter / (c + 1))**ub`), `tail_id_lr_decrease`
  (rare rows get as little as 0.1x), `counter_sgd` (`lr / sqrt(ub * c)`:
  the step falls with the row's count, not its gradients), and AdagradW
  (`adagradw`, half-life -1: the step grows with `sqrt(c)`, and decoupled
  decay catches up on absent steps).

It reports the held-out loss after each epoch on all held-out samples and on
those holding an id seen at most twice in training (the tail); `--json`
writes them and `--plot` draws both (matplotlib, an extra). The claim under
test: a counter-based rate that gives rare rows a larger step lowers the
tail's loss against the constant rate.
"""

from __future__ import annotations

import argparse
from typing import Any

import optax

from benchmarks.experiments import ctr_stream
import lazy_optax

LR = 0.05


def contenders(max_counter_update_freq: int) -> dict[str, Any]:
  """The table's rules, by name."""
  freq = dict(max_counter_update_freq=max_counter_update_freq)
  counter = lazy_optax.rowwise_adagrad_with_counter
  return {
      'constant (rowwise_adagrad)': lazy_optax.rowwise_adagrad(LR),
      'tail_id_lr_increase': counter(
          LR, learning_rate_mode='tail_id_lr_increase', adjustment_ub=0.5,
          **freq),
      'tail_id_lr_decrease': counter(
          LR, learning_rate_mode='tail_id_lr_decrease', adjustment_ub=0.5,
          **freq),
      'counter_sgd': counter(LR, learning_rate_mode='counter_sgd',
                             adjustment_ub=1.0),
      'adagradw': counter(LR, weight_decay=1e-3,
                          counter_weight_decay_mode='adagradw'),
  }


def with_dense_bias(table_tx: Any) -> optax.GradientTransformation:
  """`table_tx` on the table, Adam on the dense bias."""
  return optax.partition(
      {'table': table_tx, 'dense': optax.adam(1e-2)},
      lazy_optax.tree.path_labels(
          lambda name: 'table' if name == 'table' else 'dense'))


def run(samples: int, epochs: int, freq: int) -> dict[str, Any]:
  """`ctr_stream.compare_on_tail` of the rules, Adam on the dense bias."""
  return ctr_stream.compare_on_tail(
      {name: with_dense_bias(tx) for name, tx in contenders(freq).items()},
      samples, epochs=epochs)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--samples', type=int, default=200_000)
  parser.add_argument('--epochs', type=int, default=3)
  parser.add_argument('--max-counter-update-freq', type=int, default=20)
  ctr_stream.add_output_args(parser)
  args = parser.parse_args()
  out = run(args.samples, args.epochs, args.max_counter_update_freq)
  ctr_stream.write_outputs(out, args, ctr_stream.plot_epochs)


if __name__ == '__main__':
  main()

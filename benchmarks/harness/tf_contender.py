"""TensorFlow Addons' `LazyAdam` on the target configuration, in this process.

TensorFlow 2.15 needs numpy < 2, so this module runs in an interpreter of
its own (see benchmarks/README.md for the two commands that make it);
`benchmarks/run.py --tf-python PATH` starts it from the repository root,
pinned like every contender:

    /work/venvs/tf/bin/python -m benchmarks.harness.tf_contender '{...}'

The model and the ids are the lazy_optax target's (`contenders.py`): a
`[rows, row]` float32 table and a `[row]` weight, `loss = mean((table[ids] @
w - 1)^2)`, the same Zipf id batches. The whole train step (`tf.gather` ->
loss -> `GradientTape` -> `apply_gradients`, the table's gradient arriving as
`IndexedSlices`) runs in one `tf.function`; the optimizer step alone applies
prepared `IndexedSlices` gradients. Threads: `taskset` (by `run.py`) and TF's
intra- and inter-op thread pools. Prints one JSON object on its last line.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import numpy as np

from benchmarks.common import ids_digest
from benchmarks.common import LR
from benchmarks.common import make_batches
from benchmarks.common import peak_rss_mb
from benchmarks.common import rss_mb
from benchmarks.common import time_loop


def run(cfg: dict) -> dict:
  """Measures TF Addons' LazyAdam on one configuration; returns the results."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  tf.config.threading.set_intra_op_parallelism_threads(cfg['threads'])
  tf.config.threading.set_inter_op_parallelism_threads(cfg['threads'])
  import tensorflow_addons as tfa  # pylint: disable=g-import-not-at-top

  v, d = cfg['rows'], cfg['row']
  np_batches = make_batches(cfg)
  batches = [tf.constant(b) for b in np_batches]
  rng = np.random.default_rng(1)
  rss_base = rss_mb()
  result: dict = {'tf_version': tf.__version__,
                  'tfa_version': tfa.__version__,
                  'ids_digest': ids_digest(np_batches)}

  def fresh():
    table = tf.Variable(
        rng.random((v, d), dtype=np.float32) * np.float32(0.02) - 0.01,
        name='table')
    w = tf.Variable(tf.ones((d,), tf.float32), name='w')
    return table, w, tfa.optimizers.LazyAdam(learning_rate=LR)

  table, w, opt = fresh()

  @tf.function
  def train_step(ids):
    with tf.GradientTape() as tape:
      rows = tf.gather(table, ids)
      loss = tf.reduce_mean((tf.linalg.matvec(rows, w) - 1.0) ** 2)
    grads = tape.gradient(loss, [table, w])
    opt.apply_gradients(zip(grads, [table, w]))
    return loss

  t0 = time.perf_counter()
  train_step(batches[0]).numpy()
  result['first_step_s'] = time.perf_counter() - t0
  result['compile_s'] = result['first_step_s']  # tracing + first run

  def run_train(k):
    train_step(batches[k]).numpy()

  result['train'] = time_loop(run_train, len(batches), cfg)
  del table, w, opt
  if not cfg.get('opt', True):
    result['rss_base_mb'] = rss_base
    return result

  table, w, opt = fresh()
  g_rng = np.random.default_rng(2)
  grads_pool = []
  for b in batches[:cfg['grad_pool']]:
    vals = g_rng.normal(size=(int(b.shape[0]), d)).astype(np.float32)
    grads_pool.append((tf.IndexedSlices(tf.constant(vals), b,
                                        tf.constant([v, d])),
                       tf.ones((d,), tf.float32)))

  @tf.function
  def opt_step(g_table, g_values, g_w):
    opt.apply_gradients([(tf.IndexedSlices(g_values, g_table, [v, d]), table),
                         (g_w, w)])
    return opt.iterations

  def run_opt(k):
    g, g_w = grads_pool[k % len(grads_pool)]
    opt_step(g.indices, g.values, g_w).numpy()

  result['opt'] = time_loop(run_opt, len(grads_pool), cfg)
  result['rss_base_mb'] = rss_base
  return result


def main() -> None:
  cfg = json.loads(sys.argv[1])
  try:
    import tensorflow  # noqa: F401  pylint: disable=unused-import
    import tensorflow_addons  # noqa: F401  pylint: disable=unused-import
  except ImportError as e:
    print(json.dumps({'skipped': f'TensorFlow Addons is not importable in '
                                 f'{sys.executable} ({e})'}))
    return
  result = run(cfg)
  result['peak_rss_mb'] = peak_rss_mb()
  result['cpus'] = sorted(os.sched_getaffinity(0))
  print(json.dumps(result))


if __name__ == '__main__':
  main()

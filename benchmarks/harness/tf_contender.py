"""TensorFlow Addons' `LazyAdam` on the target configuration, in this process.

TensorFlow 2.15 needs numpy < 2, so this module runs in an interpreter of
its own (`python3 benchmarks/peers.py setup DIR` makes it);
`benchmarks/run.py` starts it from the repository root with
`$LAZY_OPTAX_TF_PYTHON` (or `--tf-python PATH`), pinned, in a process of
its own, its rounds interleaved with the other processes' rounds
(`benchmarks.common.serve`):

    $LAZY_OPTAX_TF_PYTHON -m benchmarks.harness.tf_contender '[{...}]'

The model and the ids are the lazy_optax target's (`contenders.py`): a
`[rows, row]` float32 table and a `[row]` weight, `loss = mean((table[ids] @
w - 1)^2)`, the same Zipf id batches. The whole train step (`tf.gather` ->
loss -> `GradientTape` -> `apply_gradients`, the table's gradient arriving as
`IndexedSlices`) runs in one `tf.function`; the optimizer step alone applies
prepared `IndexedSlices` gradients. Threads: `taskset` (by `run.py`) and TF's
intra- and inter-op thread pools. A missing TensorFlow Addons skips it with
a note.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import numpy as np

from benchmarks.common import ids_digest
from benchmarks.common import LR
from benchmarks.common import make_batches
from benchmarks.common import serve


def build(cfg: dict) -> tuple[dict, dict]:
  """`(info, steps)` of TF Addons' LazyAdam (`common.serve`'s `build`)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  tf.config.threading.set_intra_op_parallelism_threads(cfg['threads'])
  tf.config.threading.set_inter_op_parallelism_threads(cfg['threads'])
  import tensorflow_addons as tfa  # pylint: disable=g-import-not-at-top

  v, d = cfg['rows'], cfg['row']
  np_batches = make_batches(cfg)
  batches = [tf.constant(b) for b in np_batches]
  rng = np.random.default_rng(1)
  info: dict = {'tf_version': tf.__version__, 'tfa_version': tfa.__version__,
                'ids_digest': ids_digest(np_batches)}
  table = tf.Variable(
      rng.random((v, d), dtype=np.float32) * np.float32(0.02) - 0.01,
      name='table')
  w = tf.Variable(tf.ones((d,), tf.float32), name='w')
  opt = tfa.optimizers.LazyAdam(learning_rate=LR)

  @tf.function
  def train_step(ids):
    with tf.GradientTape() as tape:
      rows = tf.gather(table, ids)
      loss = tf.reduce_mean((tf.linalg.matvec(rows, w) - 1.0) ** 2)
    grads = tape.gradient(loss, [table, w])
    opt.apply_gradients(zip(grads, [table, w]))
    return loss

  def run_train(k):
    train_step(batches[k % len(batches)]).numpy()

  t0 = time.perf_counter()
  run_train(0)
  info['first_step_s'] = info['compile_s'] = time.perf_counter() - t0
  steps = {'train': run_train}
  if not cfg.get('opt', True):
    return info, steps

  # The optimizer step alone, on prepared IndexedSlices, on the same table.
  g_rng = np.random.default_rng(2)
  grads_pool = [
      (b, tf.constant(g_rng.normal(size=(int(b.shape[0]), d)).astype(
          np.float32)))
      for b in batches[:cfg['grad_pool']]]
  g_w = tf.ones((d,), tf.float32)

  @tf.function
  def opt_step(g_table, g_values, g_w):
    opt.apply_gradients([(tf.IndexedSlices(g_values, g_table, [v, d]), table),
                         (g_w, w)])
    return opt.iterations

  def run_opt(k):
    ids, vals = grads_pool[k % len(grads_pool)]
    opt_step(ids, vals, g_w).numpy()

  steps['opt'] = run_opt
  return info, steps


if __name__ == '__main__':
  serve(build)

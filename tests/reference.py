"""Float64 numpy models of the update rules, independent of lazy_optax.

Each model holds one table and applies a step to the rows given: ids are
deduplicated (values of repeated ids summed), out-of-range ids dropped, and
rows not given stay as they were. A dense step is a step with every row id.
Written from the rules' public descriptions: TensorFlow's LazyAdam (epsilon
hat), optax's Adam, FBGEMM's `fbgemm_gpu/codegen/genscript/optimizers.py`
(rowwise_adagrad, partial_rowwise_adam), TensorFlow's `ApplyFtrlV2`
documentation (with Keras' `beta` as an added L2 strength of
`beta / (2 * lr)`), `adam_with_counter`'s module docstring, and FBGEMM's
`ROWWISE_RMSPROP_AR` as measured against FBGEMM 1.9.0's CPU outputs.
"""

from __future__ import annotations

import numpy as np


class TFLazyAdam:
  """TensorFlow's LazyAdam rule (epsilon hat) on one table, in float64 numpy.

  t += 1; lr_t = lr*sqrt(1-b2^t)/(1-b1^t); for each touched row (duplicates
  summed first): m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g;
  p -= lr_t*m/(sqrt(v)+eps). Untouched rows do not change.
  """

  def __init__(self, table, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8,
               amsgrad=False, weight_decay=0.0):
    self.p = np.array(table, np.float64)
    self.m = np.zeros_like(self.p)
    self.v = np.zeros_like(self.p)
    self.v_max = np.zeros_like(self.p)
    self.t = 0
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.amsgrad = amsgrad
    self.weight_decay = weight_decay

  def step(self, ids, values):
    ids = np.asarray(ids)
    values = np.asarray(values, np.float64)
    self.t += 1
    lr_t = self.lr * np.sqrt(1 - self.b2 ** self.t) / (1 - self.b1 ** self.t)
    valid = (ids >= 0) & (ids < self.p.shape[0])
    summed = {}
    for i, g in zip(ids[valid], values[valid]):
      summed[int(i)] = summed.get(int(i), 0) + g
    for i, g in summed.items():
      self.m[i] = self.b1 * self.m[i] + (1 - self.b1) * g
      self.v[i] = self.b2 * self.v[i] + (1 - self.b2) * g * g
      v = self.v[i]
      if self.amsgrad:
        self.v_max[i] = np.maximum(self.v_max[i], self.v[i])
        v = self.v_max[i]
      step = lr_t * self.m[i] / (np.sqrt(v) + self.eps)
      self.p[i] = self.p[i] - step - self.lr * self.weight_decay * self.p[i]
    return sorted(summed)


def off_the_cpu(x) -> bool:
  """Whether the array `x` lives on a device other than the CPU (where XLA
  may sum duplicate rows in another order than the CPU's program does)."""
  return any(d.platform != 'cpu' for d in x.devices())


def optax_adam_rows(p, m, v, t, g, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
  """optax.adam's formulation on a block of rows, float64; returns p, m, v."""
  m = b1 * m + (1 - b1) * g
  v = b2 * v + (1 - b2) * g * g
  m_hat = m / (1 - b1 ** t)
  v_hat = v / (1 - b2 ** t)
  return p - lr * m_hat / (np.sqrt(v_hat) + eps), m, v


def summed_rows(ids, values, num_rows):
  """{row id: summed float64 gradient row} for the in-range ids."""
  ids = np.asarray(ids)
  values = np.asarray(values, np.float64)
  summed = {}
  for i, g in zip(ids, values):
    i = int(i)
    if 0 <= i < num_rows:
      summed[i] = summed.get(i, 0) + g
  return summed


def _row_mean_square(g):
  g = np.asarray(g)
  return float(np.mean(g * g)) if g.ndim else float(g * g)


class RowwiseAdagrad:
  """FBGEMM's EXACT_ROWWISE_ADAGRAD on the touched rows.

  G_r += mean(g_r'^2); w_r <- c * w_r - lr * g_r / (sqrt(G_r) + eps), with
  g_r' = g_r + wd * w_r and c = 1 - lr * wd / (sqrt(G_r) + eps) in 'l2' mode
  (so w_r -= lr * g_r' / (sqrt(G_r) + eps)), g_r' = g_r and c = 1 - lr * wd
  in 'decoupled' mode, and g_r' = g_r, c = 1 in 'none' mode.
  """

  def __init__(self, table, lr=0.1, eps=1e-8, weight_decay=0.0, mode='none',
               initial_accumulator_value=0.0):
    self.p = np.array(table, np.float64)
    self.g2 = np.full(self.p.shape[:1], initial_accumulator_value,
                      np.float64)
    self.lr, self.eps, self.wd, self.mode = lr, eps, weight_decay, mode
    self.t = 0

  def step(self, ids, values, lr=None):
    lr = self.lr if lr is None else lr
    self.t += 1
    summed = summed_rows(ids, values, self.p.shape[0])
    for r, g in summed.items():
      w = self.p[r]
      g_acc = g + self.wd * w if self.mode == 'l2' else g
      self.g2[r] += _row_mean_square(g_acc)
      multiplier = lr / (np.sqrt(self.g2[r]) + self.eps)
      if self.mode == 'l2':
        correction = 1 - multiplier * self.wd
      elif self.mode == 'decoupled':
        correction = 1 - lr * self.wd
      else:
        correction = 1.0
      self.p[r] = correction * w - multiplier * g
    return sorted(summed)


class RowwiseAdagradWithCounter:
  """FBGEMM's EXACT_ROWWISE_ADAGRAD with WeightDecayMode.COUNTER, per row.

  Written from FBGEMM's CPU kernel (`split_weight_update_cpu` of
  `rowwise_adagrad_with_counter` in codegen/genscript/optimizers.py), in
  float64: `t` starts at 1; `max_counter` becomes one plus the largest
  counter ever stored (at least 1) every `max_counter_update_freq` steps,
  before the step; `last_step` 0 means never touched.
  """

  def __init__(self, table, lr=0.1, eps=1e-8, weight_decay=0.0,
               counter_weight_decay_mode='none', counter_halflife=-1,
               adjustment_iter=-1, adjustment_ub=1.0,
               learning_rate_mode='equal', tail_id_threshold=0.0,
               tail_id_threshold_is_ratio=False,
               max_counter_update_freq=1000):
    self.p = np.array(table, np.float64)
    n = self.p.shape[0]
    self.g2 = np.zeros(n)
    self.row_counter = np.zeros(n)
    self.last_step = np.zeros(n, np.int64)
    self.lr, self.eps, self.wd = lr, eps, weight_decay
    self.mode, self.halflife = counter_weight_decay_mode, counter_halflife
    self.adj_iter, self.ub = adjustment_iter, adjustment_ub
    self.lr_mode, self.tail = learning_rate_mode, tail_id_threshold
    self.is_ratio, self.freq = tail_id_threshold_is_ratio, (
        max_counter_update_freq)
    self.max_counter, self.peak = 1.0, 1.0
    self.t = 0

  def _counter(self, r, delta):
    if self.halflife > 0:
      rho = np.log(2.0) / self.halflife
      return 1.0 + np.exp(-delta * rho) * self.row_counter[r]
    if self.halflife == 0:
      return 1.0
    return self.row_counter[r] + 1.0

  def _adjusted(self, m, c, lr, enabled):
    thr = self.tail
    if self.is_ratio:
      thr = np.floor(self.tail * self.max_counter)
    if self.lr_mode == 'equal' or not enabled or not c > thr:
      return m
    if self.lr_mode == 'tail_id_lr_increase':
      return m * max(min((self.max_counter / (c + 1.0)) ** self.ub, 10.0), 1.0)
    if self.lr_mode == 'tail_id_lr_decrease':
      return m * min(max(((c + 1.0) / self.max_counter) ** self.ub, 0.1), 1.0)
    return lr / (np.sqrt(self.ub * c) + self.eps)

  def _row(self, r, g, lr):
    t, w = self.t, self.p[r]
    delta = 1.0 if self.last_step[r] == 0 else float(t - self.last_step[r])
    c = self.row_counter[r] = self._counter(r, delta)
    freq = self.halflife / c
    g_acc = g + self.wd * w if self.mode == 'l2' else g
    self.g2[r] += _row_mean_square(g_acc)
    m = lr / (np.sqrt(self.g2[r]) + self.eps)
    enabled = self.adj_iter <= 0 or t > self.adj_iter
    adj, corr = self._adjusted(m, c, lr, enabled), 1.0
    if enabled and self.mode == 'adagradw':
      if self.halflife == -1:
        adj = m * np.sqrt(c)
      elif self.halflife == -2:
        adj = min(lr * c, self.ub) / (np.sqrt(self.g2[r]) + self.eps)
      corr = 1.0 - self.wd * lr
      lazy = corr ** (min(delta, t - self.adj_iter) - 1.0)
      adj, corr = adj * lazy, corr * lazy
    elif enabled and self.mode == 'decoupled':
      corr = 1.0 - freq * self.wd * lr
    elif enabled and self.mode == 'l2':
      corr = 1.0 - freq * self.wd * m
    self.last_step[r] = t
    self.p[r] = corr * w - adj * g
    self.peak = max(self.peak, c)

  def step(self, ids, values, lr=None):
    lr = self.lr if lr is None else lr
    self.t += 1
    if self.freq > 0 and self.t % self.freq == 0:
      self.max_counter = self.peak + 1.0
    summed = summed_rows(ids, values, self.p.shape[0])
    for r, g in summed.items():
      self._row(r, g, lr)
    return sorted(summed)


class PartialRowwiseAdam:
  """FBGEMM's PARTIAL_ROWWISE_ADAM on the touched rows (global step t).

  m_r = b1 m_r + (1-b1) g_r; v_r = b2 v_r + (1-b2) mean(g_r^2);
  w_r -= lr * (m_r/(1-b1^t) / (sqrt(v_r/(1-b2^t)) + eps) + wd * w_r).
  """

  def __init__(self, table, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8,
               weight_decay=0.0):
    self.p = np.array(table, np.float64)
    self.m = np.zeros_like(self.p)
    self.v = np.zeros(self.p.shape[:1], np.float64)
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.wd = weight_decay
    self.t = 0

  def step(self, ids, values):
    self.t += 1
    summed = summed_rows(ids, values, self.p.shape[0])
    for r, g in summed.items():
      self.m[r] = self.b1 * self.m[r] + (1 - self.b1) * g
      self.v[r] = self.b2 * self.v[r] + (1 - self.b2) * _row_mean_square(g)
      m_hat = self.m[r] / (1 - self.b1 ** self.t)
      v_hat = self.v[r] / (1 - self.b2 ** self.t)
      self.p[r] = self.p[r] - self.lr * (
          m_hat / (np.sqrt(v_hat) + self.eps) + self.wd * self.p[r])
    return sorted(summed)


class Ftrl:
  """TensorFlow's ApplyFtrlV2 per entry of the touched rows.

  The lines of docs/optimizers.md ("FTRL-Proximal"), with
  p = -learning_rate_power:

    g_s   <- g + 2 * l2_shrinkage * w
    n_new <- n + g * g
    sigma <- (n_new^p - n^p) / lr
    z     <- z + g_s - sigma * w
    q     <- (beta + n_new^p) / lr + 2 * l2
    w     <- (sign(z) * l1 - z) / q    if |z| > l1    else 0
    n     <- n_new
  """

  def __init__(self, table, lr=0.1, lr_power=-0.5,
               initial_accumulator_value=0.1, l1=0.0, l2=0.0,
               l2_shrinkage=0.0, beta=0.0):
    self.p = np.array(table, np.float64)
    self.n = np.full_like(self.p, initial_accumulator_value)
    self.z = np.zeros_like(self.p)
    self.lr, self.power = lr, -lr_power
    self.l1, self.l2, self.l2_shrinkage, self.beta = l1, l2, l2_shrinkage, beta
    self.t = 0

  def step(self, ids, values, lr=None):
    lr = self.lr if lr is None else lr
    self.t += 1
    summed = summed_rows(ids, values, self.p.shape[0])
    for r, g in summed.items():
      w, n = self.p[r], self.n[r]
      g_s = g + 2 * self.l2_shrinkage * w
      n_new = n + g * g
      sigma = (n_new ** self.power - n ** self.power) / lr
      z = self.z[r] + g_s - sigma * w
      q = (self.beta + n_new ** self.power) / lr + 2 * self.l2
      self.p[r] = np.where(np.abs(z) > self.l1,
                           (np.sign(z) * self.l1 - z) / q, 0.0)
      self.z[r] = z
      self.n[r] = n_new
    return sorted(summed)


class AdamWithCounter:
  """`adam_with_counter`'s rule on one table (per-row step counters).

  Per touched row, with t the global step and `since = t - last_step`:
  catch-up decays m, v by b^(since - 1); n is the row's count ('per_row')
  or t ('global'); p -= lr_n * m / (sqrt(v) + eps) + decay * p, with decay
  lr * wd, or 1 - (1 - lr * wd)^since over skipped steps.
  """

  def __init__(self, table, lr, b1=0.9, b2=0.999, eps=1e-8,
               bias_correction='per_row', catch_up=False, weight_decay=0.0,
               decay_skipped_steps=False):
    self.p = np.array(table, np.float64)
    self.m = np.zeros_like(self.p)
    self.v = np.zeros_like(self.p)
    self.row_count = np.zeros(self.p.shape[0], np.int64)
    self.last_step = np.zeros(self.p.shape[0], np.int64)
    self.t = 0
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.bias_correction, self.catch_up = bias_correction, catch_up
    self.wd, self.decay_skipped = weight_decay, decay_skipped_steps

  def step(self, ids, values):
    b1, b2 = self.b1, self.b2
    self.t += 1
    summed = summed_rows(ids, values, self.p.shape[0])
    for i, g in summed.items():
      since = self.t - self.last_step[i]
      if self.catch_up:
        if self.row_count[i] > 0:
          self.m[i] *= b1 ** (since - 1)
          self.v[i] *= b2 ** (since - 1)
          self.row_count[i] += since
        else:
          self.row_count[i] = 1
      else:
        self.row_count[i] += 1
      self.m[i] = b1 * self.m[i] + (1 - b1) * g
      self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
      n = self.row_count[i] if self.bias_correction == 'per_row' else self.t
      lr_n = self.lr * np.sqrt(1 - b2 ** n) / (1 - b1 ** n)
      decay = self.lr * self.wd
      if self.decay_skipped:
        decay = 1 - (1 - self.lr * self.wd) ** since
      self.p[i] = (self.p[i] - lr_n * self.m[i] / (np.sqrt(self.v[i]) +
                                                    self.eps)
                   - decay * self.p[i])
      self.last_step[i] = self.t
    return sorted(summed)


class RowwiseRmspropAr:
  """FBGEMM's ROWWISE_RMSPROP_AR on the touched rows (step t from 1).

  v_r = beta v_r + (1 - beta) mean(g_r^2); I = t - prev_r (1 if never
  touched); lambda = clip(lr alpha I, 0, 1);
  w_r = max(min_shrinkage, 1 - lambda) w_r - lr g_r / (sqrt(v_r) + eps);
  prev_r = t.
  """

  def __init__(self, table, lr=0.05, ema_beta=0.99, ar_alpha=0.0,
               min_shrinkage=0.1, eps=1e-8):
    self.p = np.array(table, np.float64)
    self.v = np.zeros(self.p.shape[:1], np.float64)
    self.prev_iter = np.zeros(self.p.shape[:1], np.int64)
    self.lr, self.beta, self.alpha = lr, ema_beta, ar_alpha
    self.min_shrinkage, self.eps = min_shrinkage, eps
    self.t = 0

  def step(self, ids, values, lr=None):
    lr = self.lr if lr is None else lr
    self.t += 1
    summed = summed_rows(ids, values, self.p.shape[0])
    for r, g in summed.items():
      self.v[r] = self.beta * self.v[r] + (1 - self.beta) * _row_mean_square(g)
      gap = 1 if self.prev_iter[r] == 0 else self.t - self.prev_iter[r]
      lam = min(max(lr * self.alpha * gap, 0.0), 1.0)
      self.p[r] = (max(self.min_shrinkage, 1 - lam) * self.p[r]
                   - lr * g / (np.sqrt(self.v[r]) + self.eps))
      self.prev_iter[r] = self.t
    return sorted(summed)


class OptaxAdam:
  """optax.adam's formulation on the touched rows of one table (global t)."""

  def __init__(self, table, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
    self.p = np.array(table, np.float64)
    self.m = np.zeros_like(self.p)
    self.v = np.zeros_like(self.p)
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.t = 0

  def step(self, ids, values):
    self.t += 1
    summed = summed_rows(ids, values, self.p.shape[0])
    for r, g in summed.items():
      self.p[r], self.m[r], self.v[r] = optax_adam_rows(
          self.p[r], self.m[r], self.v[r], self.t, g, self.lr, self.b1,
          self.b2, self.eps)
    return sorted(summed)


def _count_rows(ids, num_rows):
  """{row id: occurrences} for the in-range ids."""
  counts = {}
  for i in np.asarray(ids):
    i = int(i)
    if 0 <= i < num_rows:
      counts[i] = counts.get(i, 0) + 1
  return counts


class CowClip:
  """CowClip (Zheng et al., AAAI 2023) before another model's step.

  Each touched row's summed gradient g_r is scaled by min(1, t_r / ||g_r||),
  t_r = c_r * max(coef * ||w_r||, lower_bound), c_r the occurrences of id r
  in the step's ids (`counts='batch'`) or 1 for every distinct id
  (`counts='distinct'`: what the conformance cases pass), then `model` steps
  on the clipped rows. The model's attributes (p, m, v, ...) are its own.
  """

  _OWN = ('model', 'coef', 'lower_bound', 'counts')

  def __init__(self, model, coef=1.0, lower_bound=1e-5, counts='batch'):
    self.model, self.coef, self.lower_bound = model, coef, lower_bound
    self.counts = counts

  def __getattr__(self, name):
    return getattr(self.__dict__['model'], name)

  def __setattr__(self, name, value):  # lr and the like are the model's
    if name in self._OWN:
      object.__setattr__(self, name, value)
    else:
      setattr(self.model, name, value)

  def step(self, ids, values):
    p = self.model.p
    summed = summed_rows(ids, values, p.shape[0])
    counts = _count_rows(ids, p.shape[0])
    rows = sorted(summed)
    clipped = []
    for r in rows:
      c = counts[r] if self.counts == 'batch' else 1
      t = c * max(self.coef * np.linalg.norm(p[r]), self.lower_bound)
      norm = np.linalg.norm(summed[r])
      clipped.append(summed[r] * (t / norm if norm > t else 1.0))
    shape = (0,) + p.shape[1:]
    return self.model.step(np.array(rows, np.int64),
                           np.array(clipped) if rows else np.zeros(shape))


class RowMaxNorm:
  """Row max-norm at update time after another model's step: every row the
  step wrote is scaled to L2 norm `max_norm` where it is longer."""

  _OWN = ('model', 'max_norm')

  def __init__(self, model, max_norm):
    self.model, self.max_norm = model, max_norm

  def __getattr__(self, name):
    return getattr(self.__dict__['model'], name)

  def __setattr__(self, name, value):  # lr and the like are the model's
    if name in self._OWN:
      object.__setattr__(self, name, value)
    else:
      setattr(self.model, name, value)

  def step(self, ids, values):
    touched = self.model.step(ids, values)
    p = self.model.p
    for r in touched:
      norm = np.linalg.norm(p[r])
      if norm > self.max_norm:
        p[r] = p[r] * (self.max_norm / norm)
    return touched

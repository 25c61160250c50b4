"""The memory-traffic floor of a lazy Adam train step, measured on this machine.

A lazy Adam train step must at least read the looked-up rows of the table
(one per id), read the touched rows of the parameter, `mu` and `nu`, and
write those three back. Random rows of a table far larger than the caches
move at the machine's row gather and row scatter bandwidths, which this
script measures on three separate tables of the configuration's size with
the configuration's ids, single-threaded, taking the faster of numpy
(`take`, fancy assignment) and torch where installed (`index_select`,
`index_copy_`), so the floor is the lowest this machine shows. The floor is

    (ids + 3 * unique) * row_bytes / gather_bandwidth
        + 3 * unique * row_bytes / scatter_bandwidth

Run by `benchmarks/run.py` as `python3 -m benchmarks.harness.floor '<config
json>'` (from the repository root); prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from benchmarks.common import make_batches


def _median_time(fn, batches, repeats: int) -> float:
  samples = []
  for k in range(repeats):
    b = batches[k % len(batches)]
    t0 = time.perf_counter()
    fn(b)
    samples.append(time.perf_counter() - t0)
  return float(np.median(samples[2:]))


def main() -> None:
  cfg = json.loads(sys.argv[1])
  v, d = cfg['rows'], cfg['row']
  row_bytes = 4 * d
  batches = make_batches(cfg)
  uniques = [np.unique(b) for b in batches]
  rng = np.random.default_rng(0)
  tables = [rng.random((v, d), dtype=np.float32) for _ in range(3)]
  buf_n = np.empty((cfg['ids'], d), np.float32)
  repeats = 60

  def gather_ids(b):
    np.take(tables[0], b, axis=0, out=buf_n)

  def gather_unique(u):
    for t in tables:
      np.take(t, u, axis=0, out=buf_n[:u.size])

  def scatter_unique(u):
    for t in tables:
      t[u] = buf_n[:u.size]

  t_ids = _median_time(gather_ids, batches, repeats)
  t_gu = _median_time(gather_unique, uniques, repeats)
  t_su = _median_time(scatter_unique, uniques, repeats)
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    torch = None
  if torch is not None:
    torch.set_num_threads(1)
    tt = [torch.from_numpy(t) for t in tables]
    tb = [torch.from_numpy(b.astype(np.int64)) for b in batches]
    tu = [torch.from_numpy(u.astype(np.int64)) for u in uniques]
    out_n = torch.from_numpy(buf_n)

    def t_gather_ids(b):
      torch.index_select(tt[0], 0, b, out=out_n)

    def t_gather_unique(u):
      for t in tt:
        torch.index_select(t, 0, u, out=out_n[:u.numel()])

    def t_scatter_unique(u):
      for t in tt:
        t.index_copy_(0, u, out_n[:u.numel()])

    t_ids = min(t_ids, _median_time(t_gather_ids, tb, repeats))
    t_gu = min(t_gu, _median_time(t_gather_unique, tu, repeats))
    t_su = min(t_su, _median_time(t_scatter_unique, tu, repeats))
  n_ids = cfg['ids']
  n_unique = float(np.mean([u.size for u in uniques]))
  bw_gather = (n_ids + 3 * n_unique) * row_bytes / (t_ids + t_gu)
  bw_scatter = 3 * n_unique * row_bytes / t_su
  read = (n_ids + 3 * n_unique) * row_bytes
  written = 3 * n_unique * row_bytes
  print(json.dumps({
      'unique_rows': n_unique,
      'gather_gb_s': bw_gather / 1e9,
      'scatter_gb_s': bw_scatter / 1e9,
      'bytes_read': read,
      'bytes_written': written,
      'floor_ms': 1e3 * (read / bw_gather + written / bw_scatter),
  }))


if __name__ == '__main__':
  main()

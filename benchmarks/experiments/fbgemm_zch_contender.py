"""FBGEMM's zero-collision hash on a stream of ids, in FBGEMM's interpreter.

Started by `hashed_table.py` with the Python of a venv that holds torch and
`fbgemm-gpu-cpu` (no JAX here):

    $LAZY_OPTAX_FBGEMM_PYTHON \
        benchmarks/experiments/fbgemm_zch_contender.py \
        '{"stream": "ids.npy", "capacity": 1000000, "probe": 16, ...}'

FBGEMM's CPU `zero_collision_hash` is read-only (an inference op: it
refuses `readonly=False`); inserting exists in its CUDA op only. So, per
batch, this script

1. times the CPU op's lookup of the batch (`readonly=True`,
   `disable_fallback=True`, `circular_probe=True`): ids per second;
2. inserts the ids it did not find as FBGEMM's CUDA op does, on the host
   (NumPy): each new id probes its window (its murmur-hashed home slot, the
   same the CPU op uses, and the `probe - 1` slots after it, circularly) and
   takes the first empty slot; ids that claim one slot in the same pass go
   in batch order; an id whose window is full gets the fallback row (its
   home slot, shared with its owner). With eviction by TTL in hours, nothing
   is evicted within a run;
3. counts the lookups that got a row of their own: the slot the (fallback-
   enabled) lookup returns after the insertion holds that id.

Prints one JSON object on its last line.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def _insert(identities: np.ndarray, ids: np.ndarray, homes: np.ndarray,
            probe: int) -> None:
  """Inserts `ids` (distinct, not present) into `identities` in place."""
  size = identities.shape[0]
  pending = np.arange(ids.shape[0])
  for k in range(probe):
    if pending.size == 0:
      return
    slot = (homes[pending] + k) % size
    empty = identities[slot] == -1
    cand, cand_slot = pending[empty], slot[empty]
    # One winner per slot: the first in batch order.
    _, first = np.unique(cand_slot, return_index=True)
    winners = cand[first]
    identities[cand_slot[first]] = ids[winners]
    placed = np.zeros(ids.shape[0], bool)
    placed[winners] = True
    pending = pending[~placed[pending]]


def run(cfg: dict) -> dict:
  import fbgemm_gpu  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  import torch  # pylint: disable=g-import-not-at-top

  stream = np.load(cfg['stream'])
  capacity, probe = cfg['capacity'], cfg['probe']
  fill, steps = cfg['fill_steps'], cfg['steps']
  identities, _ = torch.ops.fbgemm.create_zch_buffer(
      capacity, support_evict=False, device=torch.device('cpu'),
      long_type=True)
  empty, _ = torch.ops.fbgemm.create_zch_buffer(
      capacity, support_evict=False, device=torch.device('cpu'),
      long_type=True)
  table = identities.numpy()[:, 0]      # shares memory with `identities`
  zch = torch.ops.fbgemm.zero_collision_hash
  times, own = [], []
  for k in range(fill + steps):
    batch = torch.from_numpy(np.ascontiguousarray(stream[k]))
    t0 = time.perf_counter()
    found, _ = zch(batch, identities, probe, circular_probe=True,
                   readonly=True, disable_fallback=True)
    elapsed = time.perf_counter() - t0
    found = found.numpy()
    missing = np.unique(stream[k][found < 0])
    if missing.size:
      # The home slot: the fallback of a lookup in an empty table.
      homes, _ = zch(torch.from_numpy(missing), empty, 1, circular_probe=True,
                     readonly=True, disable_fallback=False)
      _insert(table, missing, homes.numpy(), probe)
    if k >= fill:
      times.append(elapsed)
      slots, _ = zch(batch, identities, probe, circular_probe=True,
                     readonly=True, disable_fallback=False)
      own.append(float(np.mean(table[slots.numpy()] == stream[k])))
  n = stream.shape[1]
  return {
      'torch_version': torch.__version__,
      'fbgemm_version': getattr(fbgemm_gpu, '__version__', '?'),
      'torch_threads': torch.get_num_threads(),
      'lookup_ms': float(np.median(times) * 1e3),
      'lookup_ids_per_s': float(n / np.median(times)),
      'own_row_fraction': float(np.mean(own)),
      'filled_slots': int(np.sum(table != -1)),
  }


if __name__ == '__main__':
  print(json.dumps(run(json.loads(sys.argv[1]))))

"""Python's cyclic garbage collector, tuned for processes that trace a lot.

Tracing and lowering make many short-lived objects, so the collector runs
often, and each full collection walks everything the process holds: the
modules imported (jax, the test modules, the frameworks) and, as a run goes
on, jax's caches. Over the whole suite (2 workers on 2 cores) collections
took 17 and 20 s of each worker's 400 s. `fewer_collections()`, called
once the long-lived objects exist (after collecting the tests; before a
server forks its checks or kernels), freezes what is alive (never scanned
again, and left unwritten by the collector in forked children) and starts
a collection after 10,000 new objects instead of 700: 6 s a worker
(measured with `gc.callbacks`). Garbage is still collected, less often.
"""

import gc


def fewer_collections():
  gc.collect()
  gc.freeze()
  gc.set_threshold(10_000, 50, 100)

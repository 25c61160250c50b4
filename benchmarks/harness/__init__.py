"""The side-by-side harness: `benchmarks/run.py` and the contenders it starts.

`run.py` (the driver), one module per kind of contender (`contenders`: the
single table in JAX and torch; `dlrm`: the 26-table model; `tf_contender`
and `fbgemm_contender`, which run in interpreters of their own), the
memory-traffic floor (`floor`) and the report (`report`).
"""

"""lazy_optax's benchmarks: a package, run from the repository root.

`python3 benchmarks/run.py ...` (or `python3 -m benchmarks.run ...`) runs the
side-by-side harness in `benchmarks/harness/`; the one-off experiments in
`benchmarks/experiments/` run as modules (`python3 -m
benchmarks.experiments.huge_pages`). `benchmarks/common.py` holds what they
share. See benchmarks/README.md.
"""

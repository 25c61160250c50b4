"""One-off experiments, each a module run from the repository root.

    python3 -m benchmarks.experiments.NAME --help

They reuse the harness's measured steps (`benchmarks.harness.contenders`,
`benchmarks.harness.dlrm`) and `benchmarks.common`; what they found is
recorded, dated, in benchmarks/HISTORY.md.
"""

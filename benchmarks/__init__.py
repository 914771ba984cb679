"""Benchmarks, studies and soaks: absl scripts that measure the library, not part of it.

Run from the repository root, `PYTHONPATH=. python benchmarks/bench_scheduler.py` (or
`python -m benchmarks.bench_scheduler`). Two modules are imported, not run:
`shared_flags` (the flags the scripts share) and `records` (the JSON record of a run,
rendered into docs/benchmarks.md by tools/bench_report.py). Nothing imports a script.
"""

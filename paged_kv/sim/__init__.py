"""Workloads and replays without a model: request traces (`traces`), the synthetic
and trace-driven request workloads (`workload`), serving measurements
(`serving_bench`), replays of traces through a host pool (`replay`) or the real
scheduler with a dry executor (`engine_replay`), and the cold-start measurement
(`cold_start`). Import the submodules explicitly.
"""

"""Workloads and replays without a model: request traces, the synthetic serving
workload, replays of traces through a host pool (`replay`) or the real scheduler with
a dry executor (`engine_replay`), and the cold-start measurement (`cold_start`).
Import the submodules explicitly.
"""

"""Workloads and replays without a model: request traces, the synthetic serving
workload, and replays of traces through a host pool (`replay`) or the real scheduler
with a dry executor (`engine_replay`). Import the submodules explicitly.
"""

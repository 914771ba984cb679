"""Test setup shared by every test file."""

import os

# Keep XLA from grabbing every core per test worker; CI runs two workers.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

"""Tensor parallel: pools whose pages are sharded over kv heads (`sharding`, its names
re-exported here) and the model step run SPMD on them (`executor.ShardedModelExecutor`).

Multi-process runs (lockstep scheduling, launch) are in `paged_kv.cluster`. See
`docs/scaling.md`.
"""

from paged_kv.parallel.sharding import *  # noqa: F401,F403
from paged_kv.parallel.sharding import __all__  # noqa: F401

"""Scaling beyond one device: tensor-parallel pools (pages sharded over kv heads).

The names of `sharding` are re-exported here. Multi-process runs (one process per
host, `jax.distributed`) are in the submodules, imported on use:
`distributed` (initialize, the host `Channel`, its typed errors), `lockstep`
(`LockstepScheduler`: one schedule on every process), `executor`
(`ShardedModelExecutor`: the model step SPMD on a head-sharded pool), `launch`
(`python -m paged_kv.cluster.launch -n N -- cmd`) and `selfcheck`.

See `docs/scaling.md`.
"""

from paged_kv.parallel.sharding import *  # noqa: F401,F403
from paged_kv.parallel.sharding import __all__  # noqa: F401

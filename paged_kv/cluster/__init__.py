"""More than one process: data-parallel replicas with cache-aware routing, and one
schedule run in lockstep on every process of a multi-host job.

`replicas` (`ReplicaSet`: one process per replica) and `replica_worker`; `routing`
(the routers and their global cache view); `distributed` (`jax.distributed` setup and
the host `Channel`), `lockstep` (`LockstepScheduler`), `launch` (`python -m
paged_kv.cluster.launch -n N -- cmd`), `selfcheck`. Import the submodules explicitly.
"""

"""The model step on a pool sharded over kv heads, run SPMD on a (global) mesh.

`ShardedModelExecutor` is `paged_kv.scheduler.executor.ModelExecutor` for a pool
built by `sharding.init_sharded_pool` (pages split over kv heads along one mesh
axis, metadata replicated). Under `jax.distributed` the mesh spans every
process's devices and every process runs the same step (SPMD):

* the weights are replicated on the mesh; each device writes and attends with
  its own kv heads (the partitioner follows the pages' sharding);
* the step's outputs (tokens, statuses, logprobs) and the pool's metadata are
  replicated, so every process reads the same tokens from its own devices, and
  the pages keep their sharding (`out_shardings` pin both: compile once);
* `exact=True` (default) keeps every matmul at one device's shapes
  (`PagedAttention.activation_sharding` replicated): the q/k/v projections are
  computed whole on every device and sliced to its heads, and each layer's
  attention output is gathered over the heads before the output projection,
  so the tokens and every layer's K/V are bit-equal to one device (on CPU with
  XLA's YNNPACK fusions off, see docs/scaling.md). `exact=False` lets the
  compiler split the projections by heads (column-parallel q/k/v, row-parallel
  output projection with an all-reduce: the usual tensor-parallel layout, less
  compute per device, but ~1 ulp apart from one device).

What is sharded: the pool's pages (1/n of their bytes per device) and the
attention over them. What is not: the weights (replicated); with `exact=True`
the rest of the model (projections, MLP) runs replicated on every device.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_kv.core.config import PoolConfig
from paged_kv.core.kv import gather_kv
from paged_kv.core.state import PoolState, init_pool
from paged_kv.model import penalties
from paged_kv.parallel import sharding
from paged_kv.scheduler.executor import ModelExecutor

if TYPE_CHECKING:
  from flax import nnx

__all__ = ["ShardedModelExecutor", "set_activation_sharding", "gather_kv_replicated"]


def set_activation_sharding(model: "nnx.Module", activation_sharding) -> int:
  """Sets `activation_sharding` on every `PagedAttention` of `model`; returns how many."""
  from paged_kv.model.layers import PagedAttention  # pylint: disable=g-import-not-at-top
  from paged_kv.model.nnx_import import nnx  # pylint: disable=g-import-not-at-top
  count = 0
  for _, node in nnx.iter_graph(model):
    if isinstance(node, PagedAttention):
      node.activation_sharding = activation_sharding
      count += 1
  return count


class ShardedModelExecutor(ModelExecutor):
  """`ModelExecutor` on a pool sharded over kv heads along `axis` of `mesh` (SPMD).

  Example (every process of a `jax.distributed` run, the same arguments):
    mesh = sharding.make_tp_mesh()                       # all processes' devices
    pool = BlockPool(config, state=sharding.init_sharded_pool(config, mesh))
    executor = ShardedModelExecutor(model, config, mesh)

  Its steps (`step`, `decode_steps`) are `ModelExecutor`'s, bound with the
  outputs' shardings pinned and the weights placed on the mesh once.
  """

  def __init__(self, model: "nnx.Module", pool_config: PoolConfig, mesh: Mesh, *,
               axis: str = sharding.DEFAULT_AXIS, exact: bool = True,
               impl: str | None = None, interpret: bool | None = None):
    """Places the weights on `mesh` (replicated) and prepares the pinned-sharding step.

    Args:
      model, pool_config, impl, interpret: as for `ModelExecutor`; `model` is
        not changed (a copy gets the activation sharding).
      mesh: the pool's mesh (`jax.devices()` of every process under `jax.distributed`).
      axis: the mesh axis splitting the kv heads.
      exact: matmuls at one device's shapes, only the attention per shard
        (bit-equal to one device); False: the compiler's tensor-parallel split.

    Raises:
      ValueError: `axis` not in `mesh`, or the heads do not split evenly over it.
      ModelContractError, InvalidArgument: as for `ModelExecutor`.
    """
    from paged_kv.model.nnx_import import nnx  # pylint: disable=g-import-not-at-top
    sharding.validate_heads(pool_config.num_kv_heads, mesh, axis)
    self.mesh, self.axis, self.exact = mesh, axis, bool(exact)
    self._replicated = NamedSharding(mesh, P())
    graphdef, params = nnx.split(model)
    model = nnx.merge(graphdef, params)  # a copy of the module tree (same arrays)
    if self.exact:
      set_activation_sharding(model, self._replicated)
    super().__init__(model, pool_config, impl=impl, interpret=interpret)
    self.steps.set_params(jax.device_put(self.steps.params, self._replicated))
    if self.history is not None:  # replicated, as the steps return it
      self.history = penalties.empty_history(pool_config.max_seqs, self.history_len,
                                             sharding=self._replicated)

  def _out_shardings(self, config: PoolConfig):
    """Every step output replicated, the pool's pages sharded over `axis` (pinned:
    compile once)."""
    state_shardings = sharding.pool_shardings(
        jax.eval_shape(functools.partial(init_pool, config)), self.mesh, axis=self.axis)
    return (state_shardings, self._replicated)  # a prefix of every step's (state, out)


@functools.partial(jax.jit, static_argnames=("max_len", "out_sharding"))
def _gather(state: PoolState, seq_id: jax.Array, *, max_len: int, out_sharding):
  k, v, valid = gather_kv(state, seq_id, max_len=max_len)
  return jax.lax.with_sharding_constraint((k, v, valid), out_sharding)


def gather_kv_replicated(state: PoolState, seq_id: int, *, max_len: int,
                         mesh: Mesh) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`gather_kv` of one sequence, replicated on `mesh` (an all-gather over the heads),
  so every process can read it (`np.asarray`). For checks, not the serving path."""
  return _gather(state, jax.numpy.asarray(seq_id, jax.numpy.int32), max_len=max_len,
                 out_sharding=NamedSharding(mesh, P()))

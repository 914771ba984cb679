"""The model step on a pool sharded over kv heads, run SPMD on a (global) mesh.

Weights and outputs are replicated, each device attends with its own heads.
`exact=True` keeps every matmul at one device's shapes (bit-equal to one
device); `exact=False` lets the compiler split the projections (~1 ulp apart).
See `docs/scaling.md`.
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
  """`ModelExecutor` on a pool sharded over kv heads along `axis` of `mesh` (SPMD), e.g.

      pool = BlockPool(config, state=sharding.init_sharded_pool(config, mesh))
      executor = ShardedModelExecutor(model, config, mesh)
  """

  def __init__(self, model: "nnx.Module", pool_config: PoolConfig, mesh: Mesh, *,
               axis: str = sharding.DEFAULT_AXIS, exact: bool = True,
               impl: str | None = None, interpret: bool | None = None):
    """Places a copy of `model`'s weights on `mesh` and binds the steps with pinned shardings.

    Raises `ValueError` (bad `axis`, uneven heads) and what `ModelExecutor` raises.
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
    """Every step output replicated, the pages sharded over `axis`."""
    state_shardings = sharding.pool_shardings(
        jax.eval_shape(functools.partial(init_pool, config)), self.mesh, axis=self.axis)
    return (state_shardings, self._replicated)  # a prefix of every step's (state, out)


@functools.partial(jax.jit, static_argnames=("max_len", "out_sharding"))
def _gather(state: PoolState, seq_id: jax.Array, *, max_len: int, out_sharding):
  k, v, valid = gather_kv(state, seq_id, max_len=max_len)
  return jax.lax.with_sharding_constraint((k, v, valid), out_sharding)


def gather_kv_replicated(state: PoolState, seq_id: int, *, max_len: int,
                         mesh: Mesh) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`gather_kv` of one sequence, all-gathered so every process can read it (checks only)."""
  return _gather(state, jax.numpy.asarray(seq_id, jax.numpy.int32), max_len=max_len,
                 out_sharding=NamedSharding(mesh, P()))

"""The block pool: `BlockPool`, the validating host API over the core, and its host half.

The host half keeps numpy copies of the pool's bookkeeping (`host_state.HostState`),
decides each transition on the host (`host_transitions`, `open_row`) and hands the
device what changed (`changes.ChangeLog` -> `paged_kv.core.commit`).
"""

from paged_kv.pool.block_pool import BlockPool

__all__ = ["BlockPool"]

"""paged_kv: a functional, fragmentation-aware KV-cache memory manager for JAX."""

from paged_kv.core.alloc import allocate, apply_ref_deltas
from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import (InvalidArgument, InvalidBlock, InvalidSegment, InvalidSequence,
                             InvariantViolation, PagedKVError, PoolExhausted, RefCountUnderflow,
                             Status)
from paged_kv.core.kv import gather_kv, jit_write_kv, token_slots, write_kv
from paged_kv.core.segments import fork, open_sequence, release, reserve_tokens
from paged_kv.core.state import BlockMeta, KVPages, PoolState, SegmentTable, init_pool
from paged_kv.core.invariants import check_invariants
from paged_kv.pool import BlockPool
from paged_kv.core.slots import OWNER_EXTERNAL, cow_split, pack_slots, reclaim_slots
from paged_kv.core.compact import (CompactionPolicy, compact_permute, compact_step,
                              fragmentation_ratio, plan_compaction, region_fragmentation)
from paged_kv.core.regions import (WatermarkQuota, plan_promotion, promote_blocks, resize_pool,
                              resized_config)
from paged_kv.parallel.sharding import (init_sharded_pool, make_tp_mesh, shard_pool,
                               sharded_paged_attention, sharded_write_kv)

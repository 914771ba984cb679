"""paged_kv: a functional, fragmentation-aware KV-cache memory manager for JAX."""

from paged_kv.alloc import allocate, apply_ref_deltas
from paged_kv.config import PoolConfig
from paged_kv.errors import (InvalidArgument, InvalidBlock, InvalidSegment, InvalidSequence,
                             InvariantViolation, PagedKVError, PoolExhausted, RefCountUnderflow,
                             Status)
from paged_kv.kv import gather_kv, jit_write_kv, token_slots, write_kv
from paged_kv.segments import fork, open_sequence, release, reserve_tokens
from paged_kv.state import BlockMeta, KVPages, PoolState, SegmentTable, init_pool
from paged_kv.invariants import check_invariants
from paged_kv.pool import BlockPool

"""Pure device transitions on `PoolState`: `fn(state, ..., *, statics) -> (state, out)`.

  config, state       `PoolConfig`; `PoolState` = `KVPages` + `BlockMeta` + `SegmentTable`
  errors              `Status` codes and the typed exceptions of the host API
  segment_format      `Segments`: the one host-side segment format, `i32[n, 3]`
  alloc               `allocate`, `apply_ref_deltas`, the free list
  segments            `open_sequence`, `reserve_tokens`, `release`, `fork`
  kv                  `write_kv`, `gather_kv`, `token_slots`
  slots               `cow_split`, `pack_slots`, `reclaim_slots` (slotted blocks)
  block_size          `choose_block_size`: the block size for a length distribution (numpy)
  compact             fragmentation ratio, compaction planners, `compact_permute`
  regions             base pool promotion, watermark quotas, pool shrink/grow
  page_copy           every page move (XLA, or the Pallas kernels on request)
  invariants          `check_invariants`, the one checker every test uses

Nothing here imports host code (the pool, serving, telemetry) or flax.
"""

"""The host mirror of a pool's bookkeeping: decide on the host, apply on the device.

* `host_state.HostState` — numpy copies of `ref_count`, slot bits, the free
  index and the segment tables, changed only through mutators that record
  every change;
* `free_index.HostFreeIndex` — the device's free index arrays, on the host;
* `transitions` — the pool's transitions on the mirror, with the statuses and
  results of their jitted twins in `paged_kv.core`;
* `changes.ChangeLog` — what changed since the last commit, turned into the
  `CommitBatch`es `paged_kv.core.commit.commit` applies on the device.

`paged_kv.pool.BlockPool` uses all of it; nothing here touches the device
(`HostState.from_device` / `differences`, which read it, are the pool's reload
and debug comparison).
"""

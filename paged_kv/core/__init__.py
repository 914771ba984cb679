"""Pure device transitions on `PoolState`: `fn(state, ..., *, statics) -> (state, out)`.

One module per concept (config, state, errors, alloc, sequences, kv, slots,
compact, regions, commit, invariants, ...; the map is in `docs/architecture.md`).
Nothing here imports host code (the pool, serving, telemetry) or flax.
"""

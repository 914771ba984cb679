"""Runtime discipline: counters of device dispatches, host reads and compiles; the
persistent compilation cache.

`counters` counts what the host path costs in device terms (dispatches, blocking
reads of device data, XLA compiles), so tests assert "compile once, never wait"
exactly instead of timing it; `compile_cache` turns JAX's persistent compilation
cache on for scripts (the library never changes global JAX config on import).
"""

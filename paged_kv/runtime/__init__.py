"""Runtime discipline: counters of device dispatches, host reads and compiles; the
persistent compilation cache; host memory handed back.

`counters` counts what the host path costs in device terms (dispatches, blocking
reads of device data, XLA compiles), so tests assert "compile once, never wait"
exactly instead of timing it; `compile_cache` turns JAX's persistent compilation
cache on for scripts (the library never changes global JAX config on import);
`host_memory.return_freed_memory` fixes glibc's malloc thresholds so a long-running
process hands freed buffers back (scripts call it; nothing runs on import);
`executables` keeps the library's compiled programs below the kernel's memory-map
limit (`MapLimitNear` instead of a segfault).
"""

from paged_kv.runtime.compile_cache import (compilation_cache_dir, default_cache_dir,
                                            disable_compilation_cache, enable_compilation_cache)
from paged_kv.runtime.counters import (RuntimeCounters, RuntimeStats, backend_compiles,
                                       cache_loads, memory_mappings, resident_bytes)
from paged_kv.runtime.executables import MapLimitNear, owned_executables, release_owned
from paged_kv.runtime.host_memory import return_freed_memory

__all__ = [
    # the persistent compilation cache
    "enable_compilation_cache", "disable_compilation_cache", "compilation_cache_dir",
    "default_cache_dir",
    # counters
    "RuntimeCounters", "RuntimeStats", "backend_compiles", "cache_loads", "memory_mappings",
    "resident_bytes",
    # host memory
    "return_freed_memory",
    # compiled programs and the map limit
    "MapLimitNear", "owned_executables", "release_owned",
]

"""Runtime discipline: counters of dispatches, host reads and compiles; the persistent
compilation cache; host memory handed back; compiled programs below the map limit.

Nothing here changes global JAX or process settings on import: scripts call
`enable_compilation_cache()` and `return_freed_memory()` themselves.
"""

from paged_kv.runtime.compile_cache import (compilation_cache_dir, default_cache_dir,
                                            disable_compilation_cache, enable_compilation_cache)
from paged_kv.runtime.counters import (RuntimeCounters, backend_compiles, cache_loads,
                                       memory_mappings, resident_bytes)
from paged_kv.runtime.executables import MapLimitNear, owned_executables, release_owned
from paged_kv.runtime.host_memory import return_freed_memory

__all__ = [
    # the persistent compilation cache
    "enable_compilation_cache", "disable_compilation_cache", "compilation_cache_dir",
    "default_cache_dir",
    # counters
    "RuntimeCounters", "backend_compiles", "cache_loads", "memory_mappings",
    "resident_bytes",
    # host memory
    "return_freed_memory",
    # compiled programs and the map limit
    "MapLimitNear", "owned_executables", "release_owned",
]

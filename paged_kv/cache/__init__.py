"""The radix prefix cache bound to a block pool: `CachedPool`, persistence, governance.

The tree itself is `radix.PrefixCache`; here it meets the pool (`cached_pool`, read
through `cache_view`, its short segments packed by `packing`), is saved to and
restored from disk (`persist`) and is kept within per-namespace budgets (`governance`).
"""

from paged_kv.cache.cache_view import CacheView
from paged_kv.cache.cached_pool import CachedPool, PoolStateLost
from paged_kv.cache.persist import load_prefix_cache, save_prefix_cache

__all__ = ["CacheView", "CachedPool", "PoolStateLost", "load_prefix_cache", "save_prefix_cache"]

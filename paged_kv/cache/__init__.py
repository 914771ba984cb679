"""The radix prefix cache bound to a block pool (`CachedPool`, read through `CacheView`,
short segments packed by `packing`), saved and restored (`persist`), and kept within
budgets (`governance`). The tree itself is `radix.PrefixCache`.
"""

from paged_kv.cache.cache_view import CacheView
from paged_kv.cache.cached_pool import CachedPool, PoolStateLost
from paged_kv.cache.persist import load_prefix_cache, save_prefix_cache

__all__ = ["CacheView", "CachedPool", "PoolStateLost", "load_prefix_cache", "save_prefix_cache"]

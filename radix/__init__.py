"""Host-side radix prefix cache (numpy only; imports neither JAX nor paged_kv).

``radix.tree`` is the pure radix tree over token ids; ``radix.cache`` binds its nodes
to block-pool segments (``radix.segments``) and returns the reference deltas the caller
applies to the pool; ``radix.eviction`` chooses what an eviction takes.
"""

from radix.cache import (
    CacheCounters,
    InsertOutcome,
    MatchResult,
    PackCandidate,
    PrefixCache,
)
from radix.eviction import (
    EvictableReport,
    Eviction,
    GRANULARITIES,
    GcMark,
    POLICIES,
)
from radix.segments import (
    InvalidSegmentsError,
    RefCountMismatchError,
    RefDeltas,
    as_segments,
)
from radix.tree import (
    HitStats,
    InsertResult,
    InvalidNamespaceError,
    InvalidTokensError,
    LockError,
    Node,
    NodeId,
    PrefixMatch,
    RadixTree,
    RadixTreeError,
    Split,
    StaleNodeError,
    as_tokens,
    check_namespace,
)

__all__ = [
    "CacheCounters",
    "EvictableReport",
    "Eviction",
    "GRANULARITIES",
    "GcMark",
    "HitStats",
    "InsertOutcome",
    "InsertResult",
    "InvalidNamespaceError",
    "InvalidSegmentsError",
    "InvalidTokensError",
    "LockError",
    "MatchResult",
    "Node",
    "NodeId",
    "POLICIES",
    "PackCandidate",
    "PrefixCache",
    "PrefixMatch",
    "RadixTree",
    "RadixTreeError",
    "RefCountMismatchError",
    "RefDeltas",
    "Split",
    "StaleNodeError",
    "as_segments",
    "as_tokens",
    "check_namespace",
]

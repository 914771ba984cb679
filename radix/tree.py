"""A host-side radix tree over token ids, with namespaces, lock refs and hit statistics.

Numpy only. Each namespace (tenant, adapter, cache salt) has its own root, so equal
token sequences in two namespaces never share a node. A node holds its edge's tokens
as one ``int32[n]`` span and an opaque ``value`` that the ``split_value`` function
cuts in two when the node is split, so a value describing the tokens (the cache's
segments) stays aligned with them.

Node ids are never reused, so a stale handle raises instead of aliasing a new node.
A split keeps the node's id on its tail (tokens ``[k:]``, children, leaf-ness) and
gives the head a new id: a handle to a leaf survives splits. ``lock`` counts on the
node and its ancestors; locked nodes are never removed. The tree reads no clock:
callers pass ``now``, and ``access_seq`` breaks ties between equal times.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import numpy as np

__all__ = [
    "HitStats",
    "InsertResult",
    "InvalidTokensError",
    "LockError",
    "Node",
    "NodeId",
    "PrefixMatch",
    "RadixTree",
    "RadixTreeError",
    "Split",
    "StaleNodeError",
    "InvalidNamespaceError",
    "as_tokens",
    "check_namespace",
]

NodeId = int

_INT32_MIN = np.iinfo(np.int32).min
_INT32_MAX = np.iinfo(np.int32).max


class RadixTreeError(Exception):
  """Base class of the errors raised by the radix tree and the prefix cache."""


class InvalidTokensError(RadixTreeError, ValueError):
  """Token ids are not a 1-D sequence of integers representable as int32."""


class StaleNodeError(RadixTreeError, KeyError):
  """A node id names no live node (never existed, or removed since)."""


class LockError(RadixTreeError):
  """A lock/unlock/remove request conflicts with the node's lock state."""


class InvalidNamespaceError(RadixTreeError, TypeError):
  """A namespace is not a typed key (``str``, ``bytes``, ``int`` or a tuple of them)."""


_NAMESPACE_SCALARS = (str, bytes, int)
# Size caps of a namespace key (a tenant id, not a payload): nesting, scalars in all,
# characters (str) or bytes of each, and ints within int64.
MAX_NAMESPACE_DEPTH = 8
MAX_NAMESPACE_PARTS = 64
MAX_NAMESPACE_LENGTH = 1024


def check_namespace(namespace: Any) -> Hashable:
  """Validates a namespace (a typed key) and returns it unchanged.

  A ``str``, ``bytes`` or ``int`` (exactly: not ``bool``, a numpy integer or
  ``float``), or a tuple of them, so ``1``, ``1.0`` and ``True`` never name one
  tenant. Capped by ``MAX_NAMESPACE_DEPTH``, ``MAX_NAMESPACE_PARTS``,
  ``MAX_NAMESPACE_LENGTH`` and int64; checked without recursion.

  Raises:
    InvalidNamespaceError: another type, or a cap exceeded (named).
  """
  stack = [(namespace, 0)]
  parts = 0
  while stack:
    key, depth = stack.pop()
    if isinstance(key, tuple):
      if depth >= MAX_NAMESPACE_DEPTH:
        raise InvalidNamespaceError(
            f"namespace tuples nest deeper than MAX_NAMESPACE_DEPTH={MAX_NAMESPACE_DEPTH}")
      if len(key) + parts > MAX_NAMESPACE_PARTS:
        raise InvalidNamespaceError(
            f"namespace has more than MAX_NAMESPACE_PARTS={MAX_NAMESPACE_PARTS} parts")
      stack.extend((part, depth + 1) for part in key)
      continue
    if type(key) not in _NAMESPACE_SCALARS:
      raise InvalidNamespaceError(
          f"namespace must be a str, bytes, int (not bool or a numpy scalar) or a tuple of "
          f"them, got {key!r} of type {type(key).__name__}")
    parts += 1
    if parts > MAX_NAMESPACE_PARTS:
      raise InvalidNamespaceError(
          f"namespace has more than MAX_NAMESPACE_PARTS={MAX_NAMESPACE_PARTS} parts")
    if type(key) is int:
      if not -(1 << 63) <= key < (1 << 63):
        raise InvalidNamespaceError(f"namespace int {key} is outside int64")
    elif len(key) > MAX_NAMESPACE_LENGTH:
      raise InvalidNamespaceError(
          f"namespace {type(key).__name__} of length {len(key)} is longer than "
          f"MAX_NAMESPACE_LENGTH={MAX_NAMESPACE_LENGTH}")
  return namespace


def as_tokens(tokens: Any) -> np.ndarray:
  """Validates token ids (1-D integers within int32); returns a C-contiguous ``int32[n]``.

  An ``int32[n]`` array comes back without a copy. Raises ``InvalidTokensError``.
  """
  if isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 and tokens.ndim == 1:
    return np.ascontiguousarray(tokens)
  try:
    arr = np.asarray(tokens)
  except (TypeError, ValueError) as e:  # ragged input and the like
    raise InvalidTokensError(f"token ids are not an array: {e}") from e
  if arr.ndim != 1:
    raise InvalidTokensError(f"token ids must be 1-D, got shape {arr.shape}")
  if arr.size == 0:
    return np.zeros((0,), np.int32)
  if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
    raise InvalidTokensError(f"token ids must be integers, got dtype {arr.dtype}")
  if arr.min() < _INT32_MIN or arr.max() > _INT32_MAX:
    raise InvalidTokensError("token ids must fit in int32")
  return np.ascontiguousarray(arr, dtype=np.int32)


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
  """Length of the longest common prefix of two int32 arrays."""
  n = min(a.shape[0], b.shape[0])
  if n == 0:
    return 0
  if a[:n].tobytes() == b[:n].tobytes():  # the usual case on a walk: a memcmp
    return n
  neq = np.flatnonzero(a[:n] != b[:n])
  return int(neq[0])


@dataclasses.dataclass(eq=False, slots=True)
class Node:
  """One edge of the radix tree (identity semantics: two nodes are never equal).

  Attributes:
    key: int32[num_tokens], the edge's tokens (empty only for a root).
    depth: tokens from the root to the first token of ``key``.
    children: first token id -> child node.
    value: payload describing ``key`` (cut by ``split_value``).
    lock_ref: outstanding locks on this node or a descendant.
    last_access, access_seq: time of the last touch, and its tie-breaker.
    hit_count, hit_tokens: matches covering the node, and their tokens in it.
    pinned_until: not evictable while ``now < pinned_until``.
    gc_marked: set by a GC mark phase, cleared by a touch.
  """

  node_id: NodeId
  namespace: Hashable
  key: np.ndarray
  depth: int
  parent: Node | None
  children: dict[int, Node] = dataclasses.field(default_factory=dict)
  value: Any = None
  lock_ref: int = 0
  last_access: float = 0.0
  access_seq: int = 0
  hit_count: int = 0
  hit_tokens: int = 0
  pinned_until: float = float("-inf")
  gc_marked: bool = False

  @property
  def num_tokens(self) -> int:
    return int(self.key.shape[0])

  @property
  def is_root(self) -> bool:
    return self.parent is None

  @property
  def is_leaf(self) -> bool:
    return not self.children and self.parent is not None

  def is_pinned(self, now: float) -> bool:
    return now < self.pinned_until


@dataclasses.dataclass(frozen=True)
class HitStats:
  """Prefix-hit statistics, global or of one namespace: recorded queries, queries that
  matched a token, tokens asked for and tokens matched.
  """

  num_queries: int = 0
  num_hit_queries: int = 0
  query_tokens: int = 0
  hit_tokens: int = 0

  @property
  def hit_rate(self) -> float:
    """``hit_tokens / query_tokens`` (0.0 before any query)."""
    return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

  def __add__(self, other: HitStats) -> HitStats:
    return HitStats(self.num_queries + other.num_queries,
                    self.num_hit_queries + other.num_hit_queries,
                    self.query_tokens + other.query_tokens, self.hit_tokens + other.hit_tokens)


_NO_HITS = HitStats()


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
  """Result of ``RadixTree.match_prefix``.

  Attributes:
    length: leading query tokens found.
    path: node ids covering them, root side first; all but the last matched whole.
    last_offset: tokens matched within the last node (0 when ``path`` is empty).
  """

  length: int
  path: tuple[NodeId, ...]
  last_offset: int

  @property
  def node(self) -> NodeId | None:
    """The deepest node the match touched (the one to lock), or None."""
    return self.path[-1] if self.path else None


@dataclasses.dataclass(frozen=True)
class Split:
  """One node split: ``head`` (new id) took the first ``offset`` tokens of ``tail``."""

  head: NodeId
  tail: NodeId
  offset: int


@dataclasses.dataclass(frozen=True)
class InsertResult:
  """Result of ``RadixTree.insert``: tokens already held (``prefix_len``), the new leaf
  (None when nothing new) and the split it made (at most one).
  """

  prefix_len: int
  leaf: NodeId | None
  splits: tuple[Split, ...]


def _no_value_split(value: Any, offset: int) -> tuple[Any, Any]:
  if value is not None:
    raise TypeError("this RadixTree was built without split_value; node values " "must be None")
  return None, None


class RadixTree:
  """Radix tree over int32 token ids, one root per namespace.

  Args:
    split_value: ``f(value, offset) -> (head, tail)`` cuts a node's value at a split;
      the default accepts only ``None`` values.
  """

  def __init__(self, split_value: Callable[[Any, int], tuple[Any, Any]] | None = None):
    self._split_value = split_value or _no_value_split
    self._ids = itertools.count(1)
    self._access = itertools.count(1)
    self._roots: dict[Hashable, Node] = {}
    self._nodes: dict[NodeId, Node] = {}
    self._leaves: set[Node] = set()
    self._stats: dict[Hashable, HitStats] = {}
    self._num_tokens = 0
    # The leaves in LRU order, kept lazily (see `lru_peek`): a heap of
    # `(last_access, access_seq, node_id)` entries and each leaf's current entry.
    self._lru: list[tuple[float, int, NodeId]] = []
    self._lru_entry: dict[NodeId, tuple[float, int, NodeId]] = {}
    self._lru_stale = False  # a touch moved a node back in time: rebuild before use

  # ------------------------------------------------------------------ access
  def node(self, node_id: NodeId) -> Node:
    """The live node ``node_id``, for reading (``StaleNodeError`` if none)."""
    try:
      return self._nodes[node_id]
    except (KeyError, TypeError):
      raise StaleNodeError(f"no live radix node with id {node_id!r}") from None

  def __contains__(self, node_id: object) -> bool:
    return node_id in self._nodes

  def __len__(self) -> int:
    """Number of live non-root nodes."""
    return len(self._nodes)

  @property
  def num_tokens(self) -> int:
    """Total tokens stored on all edges (every namespace)."""
    return self._num_tokens

  def namespaces(self) -> list[Hashable]:
    return list(self._roots)

  def nodes(self) -> Iterator[Node]:
    """All live non-root nodes, in no particular order."""
    return iter(list(self._nodes.values()))

  def leaves(self) -> Iterator[Node]:
    """All live leaves."""
    return iter(list(self._leaves))

  def path_tokens(self, node_id: NodeId) -> np.ndarray:
    """int32[depth + num_tokens]: the tokens from the root to the node's end."""
    node = self.node(node_id)
    parts = []
    while node is not None and node.parent is not None:
      parts.append(node.key)
      node = node.parent
    return np.concatenate(parts[::-1]) if parts else np.zeros((0,), np.int32)

  def sequences(self, namespace: Hashable) -> list[np.ndarray]:
    """The token arrays of every root-to-leaf path of a namespace."""
    root = self._roots.get(namespace)
    if root is None:
      return []
    return [
        self.path_tokens(leaf.node_id) for leaf in list(self._leaves) if leaf.namespace == namespace
    ]

  def stats(self, namespace: Hashable | None = None) -> HitStats:
    """Hit statistics of one namespace, or summed over all when None."""
    if namespace is None:
      total = HitStats()
      for s in self._stats.values():
        total = total + s
      return total
    return self._stats.get(namespace, HitStats())

  # ------------------------------------------------------------------ helpers
  def _root(self, namespace: Hashable, create: bool) -> Node | None:
    check_namespace(namespace)
    root = self._roots.get(namespace)
    if root is None and create:
      root = Node(
          node_id=0, namespace=namespace, key=np.zeros((0,), np.int32), depth=0, parent=None
      )
      self._roots[namespace] = root
    return root

  # ------------------------------------------------------------------ LRU order
  def _add_leaf(self, node: Node) -> None:
    self._leaves.add(node)
    self.lru_push(node)

  def lru_push(self, node: Node) -> None:
    """(Re)enters leaf ``node`` in the LRU index at its current access time."""
    entry = (node.last_access, node.access_seq, node.node_id)
    self._lru_entry[node.node_id] = entry
    heapq.heappush(self._lru, entry)

  def lru_peek(self) -> tuple[float, int, NodeId] | None:
    """The least recently used leaf's ``(last_access, access_seq, node_id)``, or None.

    The index is a heap cleaned lazily (removed nodes and ex-leaves dropped, touched
    leaves re-entered when they surface): O(log leaves) amortized.
    """
    if self._lru_stale or len(self._lru) > 2 * len(self._leaves) + 64:
      self._lru = [(n.last_access, n.access_seq, n.node_id) for n in self._leaves]
      heapq.heapify(self._lru)
      self._lru_entry = {e[2]: e for e in self._lru}
      self._lru_stale = False
    heap = self._lru
    while heap:
      entry = heap[0]
      nid = entry[2]
      node = self._nodes.get(nid)
      if node is None or self._lru_entry.get(nid) is not entry or node.children:
        heapq.heappop(heap)  # removed, superseded, or no longer a leaf
        if node is not None and node.children and self._lru_entry.get(nid) is entry:
          del self._lru_entry[nid]
        continue
      if node.last_access != entry[0] or node.access_seq != entry[1]:
        current = (node.last_access, node.access_seq, nid)  # touched since: later now
        self._lru_entry[nid] = current
        heapq.heapreplace(heap, current)
        continue
      return entry
    return None

  def lru_pop(self) -> Node | None:
    """Takes the LRU leaf off the index (``lru_push`` it back unless removed)."""
    entry = self.lru_peek()
    if entry is None:
      return None
    heapq.heappop(self._lru)
    del self._lru_entry[entry[2]]
    return self._nodes[entry[2]]

  def _touch(self, node: Node, now: float) -> None:
    if now < node.last_access:
      self._lru_stale = True  # a clock that went back: the lazy order would be wrong
    node.last_access = now
    node.access_seq = next(self._access)
    node.gc_marked = False

  def _walk(self, root: Node, tokens: np.ndarray) -> tuple[list[Node], int, int]:
    """Longest match: (path nodes, matched length, tokens matched in last node)."""
    path: list[Node] = []
    node, pos, off = root, 0, 0
    n = tokens.shape[0]
    while pos < n:
      child = node.children.get(int(tokens[pos]))
      if child is None:
        break
      m = _common_prefix_len(child.key, tokens[pos:])
      path.append(child)
      pos += m
      off = m
      if m < child.num_tokens:
        break
      node = child
    return path, pos, off

  # ------------------------------------------------------------------ queries
  def match_prefix(
      self, namespace: Hashable, tokens: Any, *, now: float, record: bool = True
  ) -> PrefixMatch:
    """Longest prefix of ``tokens`` held in ``namespace``'s tree (no split).

    ``record`` stamps ``now`` on the path and updates hit statistics; False leaves
    the tree untouched. Raises ``InvalidTokensError``, ``InvalidNamespaceError``.
    """
    tokens = as_tokens(tokens)
    root = self._root(namespace, create=False)
    if root is None:
      path, length, off = [], 0, 0
    else:
      path, length, off = self._walk(root, tokens)
    if record:
      for i, node in enumerate(path):
        self._touch(node, now)
        node.hit_count += 1
        node.hit_tokens += node.num_tokens if i + 1 < len(path) else off
      prev = self._stats.get(namespace, _NO_HITS)
      self._stats[namespace] = HitStats(prev.num_queries + 1, prev.num_hit_queries + (length > 0),
                                        prev.query_tokens + int(tokens.shape[0]),
                                        prev.hit_tokens + length)
    return PrefixMatch(length=length, path=tuple(n.node_id for n in path), last_offset=off)

  # ------------------------------------------------------------------ updates
  def split(self, node_id: NodeId, offset: int) -> NodeId:
    """Splits a node after ``offset`` tokens; returns the new head's id.

    The node keeps its id and tail; the head becomes its parent and copies its lock
    count, access time, hit counts, pin and GC mark. Raises ``StaleNodeError``,
    ``ValueError`` (offset outside ``[1, num_tokens - 1]``).
    """
    node = self.node(node_id)
    if not 0 < offset < node.num_tokens:
      raise ValueError(f"split offset {offset} outside [1, {node.num_tokens - 1}]")
    head_value, tail_value = self._split_value(node.value, offset)
    parent = node.parent
    assert parent is not None
    head = Node(
        node_id=next(self._ids),
        namespace=node.namespace,
        key=node.key[:offset],
        depth=node.depth,
        parent=parent,
        value=head_value,
        lock_ref=node.lock_ref,
        last_access=node.last_access,
        access_seq=node.access_seq,
        hit_count=node.hit_count,
        hit_tokens=min(node.hit_tokens, node.hit_count * offset),
        pinned_until=node.pinned_until,
        gc_marked=node.gc_marked,
    )
    node.hit_tokens -= head.hit_tokens
    first = int(node.key[0])
    node.key = node.key[offset:]
    node.depth += offset
    node.value = tail_value
    node.parent = head
    head.children[int(node.key[0])] = node
    parent.children[first] = head
    self._nodes[head.node_id] = head
    return head.node_id

  def insert(
      self,
      namespace: Hashable,
      tokens: Any,
      make_value: Callable[[int], Any] | None = None,
      *,
      now: float,
  ) -> InsertResult:
    """Inserts ``tokens`` into ``namespace``'s tree; the new tokens go into one new leaf.

    Tokens already held keep their value; a node diverging inside is split.
    ``make_value(prefix_len)`` builds the leaf's value before any change (it may
    raise to abort). Raises ``InvalidTokensError``, ``InvalidNamespaceError``; nothing
    changes on error.
    """
    tokens = as_tokens(tokens)
    root = self._root(namespace, create=True)
    path, length, off = self._walk(root, tokens)
    n = int(tokens.shape[0])
    if length == n:
      for node in path:
        self._touch(node, now)
      return InsertResult(prefix_len=length, leaf=None, splits=())
    value = make_value(length) if make_value is not None else None
    splits: tuple[Split, ...] = ()
    if path and off < path[-1].num_tokens:
      tail = path[-1]
      head_id = self.split(tail.node_id, off)
      splits = (Split(head=head_id, tail=tail.node_id, offset=off),)
      path[-1] = self._nodes[head_id]
    parent = path[-1] if path else root
    leaf = Node(
        node_id=next(self._ids),
        namespace=namespace,
        key=tokens[length:].copy(),
        depth=length,
        parent=parent,
        value=value,
    )
    parent.children[int(leaf.key[0])] = leaf
    self._leaves.discard(parent)
    self._nodes[leaf.node_id] = leaf
    self._num_tokens += leaf.num_tokens
    for node in path:
      self._touch(node, now)
    self._touch(leaf, now)
    self._add_leaf(leaf)
    return InsertResult(prefix_len=length, leaf=leaf.node_id, splits=splits)

  def remove_leaf(self, node_id: NodeId) -> Any:
    """Removes an unlocked leaf; returns its value (``StaleNodeError``, ``LockError``)."""
    node = self.node(node_id)
    if node.children:
      raise LockError(f"node {node_id} is not a leaf")
    if node.lock_ref:
      raise LockError(f"node {node_id} is locked (lock_ref={node.lock_ref})")
    parent = node.parent
    assert parent is not None
    del parent.children[int(node.key[0])]
    del self._nodes[node_id]
    self._leaves.discard(node)
    self._lru_entry.pop(node_id, None)
    self._num_tokens -= node.num_tokens
    if parent.parent is not None and not parent.children:
      self._add_leaf(parent)
    if parent.parent is None and not parent.children:
      del self._roots[parent.namespace]
    node.parent = None
    return node.value

  def _path_to_root(self, node: Node) -> Iterator[Node]:
    while node.parent is not None:
      yield node
      node = node.parent

  def lock(self, node_id: NodeId) -> None:
    """Adds one lock on the node and each of its ancestors."""
    for node in self._path_to_root(self.node(node_id)):
      node.lock_ref += 1

  def unlock(self, node_id: NodeId) -> None:
    """Removes one lock from the node and its ancestors (``LockError`` if unlocked)."""
    node = self.node(node_id)
    if node.lock_ref <= 0:
      raise LockError(f"node {node_id} is not locked")
    for n in self._path_to_root(node):
      n.lock_ref -= 1

  def reset_locks(self, held: Iterable[NodeId]) -> None:
    """Recomputes every ``lock_ref`` from ``held``, one entry per outstanding lock
    (repeats count, stale ids ignored); every other lock is dropped.
    """
    for node in self._nodes.values():
      node.lock_ref = 0
    for node_id in held:
      if node_id in self._nodes:
        self.lock(node_id)

  def pin(self, node_id: NodeId, until: float) -> None:
    """Pins the node and its ancestors until time ``until`` (extends, never shortens)."""
    for node in self._path_to_root(self.node(node_id)):
      node.pinned_until = max(node.pinned_until, until)

  def unpin(self, node_id: NodeId) -> None:
    """Clears the pin of the node and of its descendants (ancestors keep theirs)."""
    stack = [self.node(node_id)]
    while stack:
      node = stack.pop()
      node.pinned_until = float("-inf")
      stack.extend(node.children.values())

  def subtree(self, node_id: NodeId) -> list[Node]:
    """The node and all its descendants (preorder)."""
    out, stack = [], [self.node(node_id)]
    while stack:
      node = stack.pop()
      out.append(node)
      stack.extend(node.children.values())
    return out

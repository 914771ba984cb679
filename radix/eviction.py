"""Choosing what an eviction takes from the cache's tree, without changing it.

``EvictionPlanner.select`` walks evictable leaves in a policy's order and takes each
leaf's segments tail first until the decrefs would free the blocks (or drop the
tokens) asked for; ``PrefixCache`` removes what it chose.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable
from typing import Any

import numpy as np

from radix.segments import EMPTY_IDS, SMALL_SEGMENTS, RefCountMismatchError, RefDeltas
from radix.tree import Node, NodeId, RadixTree

__all__ = [
    "EvictableReport",
    "EvictionPlanner",
    "Eviction",
    "GC_ORDERS",
    "GRANULARITIES",
    "GcMark",
    "POLICIES",
    "cost_key",
    "gc_key",
    "lru_key",
]

POLICIES = ("lru", "cost")
GRANULARITIES = ("block", "node")
GC_ORDERS = ("high_first", "low_first")


@dataclasses.dataclass(frozen=True)
class Eviction:
  """Result of ``evict`` / ``gc_evict``.

  Attributes:
    ref_deltas: the tree's decrefs (-1 per evicted segment) for the pool.
    nodes: evicted node ids, children before parents.
    num_freed_blocks: blocks the decrefs free given the ``ref_count`` passed (None without).
  """

  ref_deltas: RefDeltas
  nodes: tuple[NodeId, ...]
  num_tokens: int
  num_segments: int
  num_freed_blocks: int | None


@dataclasses.dataclass(frozen=True)
class GcMark:
  """Result of ``gc_mark``: nodes (and their tokens) marked as GC candidates."""

  num_nodes: int
  num_tokens: int


@dataclasses.dataclass(frozen=True)
class EvictableReport:
  """What eviction could reclaim now (unlocked, unpinned nodes): nodes, tokens,
  segments, ``num_tokens * bytes_per_token`` bytes, the blocks freed if all of it
  went (None without ``ref_count``), and the tokens the GC has marked.
  """

  num_nodes: int
  num_tokens: int
  num_segments: int
  num_bytes: int
  num_blocks: int | None
  num_gc_marked_tokens: int


def lru_key(node: Node) -> tuple:
  return (node.last_access, node.access_seq)


def cost_key(node: Node) -> tuple:
  return (node.hit_tokens / max(node.num_tokens, 1), node.last_access, node.access_seq)


def gc_key(order: str) -> Callable[[Node], tuple]:
  """The GC's order: the node holding the highest (``"high_first"``) or lowest block first."""
  sign = -1 if order == "high_first" else 1

  def key(n: Node) -> tuple:
    blocks = n.value[:, 0]
    addr = int(blocks.max() if sign < 0 else blocks.min()) if blocks.size else 0
    return (sign * addr, n.last_access, n.access_seq)
  return key


class EvictionPlanner:
  """Picks the leaves (and tail segments) an eviction takes from ``tree``.

  Its per-block scratch arrays stay zero (``_known``: -1) between calls, so a
  selection costs what it touches, not the pool's size.
  """

  def __init__(self, tree: RadixTree):
    self.tree = tree
    self._scratch = np.zeros((0,), np.int64)  # per block, zero between calls
    self._known = np.zeros((0,), np.int64)  # per block, -1 between calls

  def check_ref_count(self, ref_count: Any) -> np.ndarray | Callable[[np.ndarray], np.ndarray]:
    if callable(ref_count):
      return ref_count
    rc = np.asarray(ref_count)
    if rc.ndim != 1 or not np.issubdtype(rc.dtype, np.integer):
      raise RefCountMismatchError(
          f"ref_count must be a 1-D integer array or a lookup, got " f"{rc.dtype}{rc.shape}"
      )
    self._grow(rc.shape[0])
    return rc

  def select(
      self,
      eligible: Callable[[Node], bool],
      key: Callable[[Node], tuple],
      num_blocks: int | None,
      ref_count: np.ndarray | Callable[[np.ndarray], np.ndarray] | None,
      num_tokens: int | None,
      countable: np.ndarray | None = None,
      granularity: str = "block",
      lru_index: bool = False,
  ) -> tuple[list[tuple[Node, int]], int | None]:
    """Picks what to evict; returns ``(chosen, freed)`` and changes nothing.

    ``chosen`` lists ``(node, first)`` children first: the node's segments ``[first:]``
    go (0: all of it). ``ref_count`` is an array or a lookup ``f(block_ids)`` asked
    about a few blocks at a time (prefetched in doubling batches). ``lru_index`` (with
    ``lru_key``) pops leaves off the tree's LRU index instead of heaping every eligible
    leaf: the same order, O(log leaves) each.
    """
    tree = self.tree
    if lru_index:
      heap: list = []
    else:
      heap = [(key(n), n.node_id, n) for n in tree.leaves() if eligible(n)]
      heapq.heapify(heap)
    taken_off: list[Node] = []  # off the LRU index: put back at the end

    def next_node() -> Node | None:
      if not lru_index:
        return heapq.heappop(heap)[2] if heap else None
      while True:
        top = tree.lru_peek()
        if heap and (top is None or (heap[0][0], heap[0][1]) < ((top[0], top[1]), top[2])):
          return heapq.heappop(heap)[2]
        if top is None:
          return None
        node = tree.lru_pop()
        taken_off.append(node)
        if eligible(node):
          return node
    remaining: dict[int, int] = {}
    chosen: list[tuple[Node, int]] = []
    tokens = 0
    freed = 0 if ref_count is not None else None
    trim = granularity == "block"
    touched: list[np.ndarray] = []  # entries of _scratch / _known to reset
    prefetch = 8
    # A host array (or no) ref_count: each node is taken in plain Python, the tree's
    # references chosen so far counted per block in `pending`, until a node longer
    # than `SMALL_SEGMENTS`. Then, or with a lookup: numpy, the counts in `_scratch`
    # (a lookup's answers in `_known`).
    plain = not callable(ref_count)
    pending: dict[int, int] = {}

    def counts(blocks: np.ndarray) -> np.ndarray:
      nonlocal prefetch
      if not callable(ref_count):
        if int(blocks.max()) >= ref_count.shape[0]:
          raise RefCountMismatchError(
              f"tree references block {int(blocks.max())} but ref_count has "
              f"{ref_count.shape[0]} entries")
        return ref_count[blocks].astype(np.int64)
      if (self._known[blocks] < 0).any():
        # This node's blocks plus those of the next few candidates: one lookup.
        ahead = [n.value[:, 0] for _, _, n in heapq.nsmallest(prefetch, heap)]
        prefetch *= 2
        ids = np.unique(np.concatenate([blocks] + ahead)).astype(np.int64)
        self._grow(int(ids[-1]) + 1)
        ids = ids[self._known[ids] < 0]
        got = np.asarray(ref_count(ids)).reshape(-1)
        if got.shape != ids.shape:
          raise RefCountMismatchError(
              f"ref_count lookup returned {got.shape[0]} counts for {ids.shape[0]} blocks")
        self._known[ids] = got
        touched.append(ids)
      return self._known[blocks]

    try:
      while True:
        if num_tokens is not None and tokens >= num_tokens:
          break
        if num_blocks is not None and freed is not None and freed >= num_blocks:
          break
        node = next_node()
        if node is None:
          break
        if plain and node.value.shape[0] > SMALL_SEGMENTS:
          # A long node: the vectorised path from here on, the counts so far moved over.
          plain = False
          if pending:
            ids = np.fromiter(pending, np.int64, len(pending))
            self._grow(int(ids.max()) + 1)
            self._scratch[ids] += np.fromiter(pending.values(), np.int64, len(pending))
            touched.append(ids)
        if plain:  # a host ref_count (or none): the node's segments one by one
          k, n_segs, tokens, freed = self._take_plain(node.value, pending, tokens, freed,
                                                      num_blocks, ref_count, num_tokens,
                                                      countable, trim)
        else:
          k, n_segs, tokens, freed = self._take_looked_up(
              node.value, None if ref_count is None else counts, touched, tokens, freed,
              num_blocks, num_tokens, countable, trim)
        first = n_segs - k
        chosen.append((node, first))
        if first > 0:
          break  # the node is trimmed: the target is met
        parent = node.parent
        if parent is not None and parent.parent is not None:
          pid = parent.node_id
          left_children = remaining.get(pid, len(parent.children)) - 1
          remaining[pid] = left_children
          if left_children == 0 and eligible(parent):
            heapq.heappush(heap, (key(parent), pid, parent))
    finally:
      for ids in touched:
        self._scratch[ids] = 0
        self._known[ids] = -1
      for node in taken_off:
        tree.lru_push(node)  # nothing changed yet: the commit removes the chosen ones
    return chosen, freed

  def _take_looked_up(self, segs: np.ndarray, counts: Callable[[np.ndarray], np.ndarray] | None,
                      touched: list, tokens: int, freed: int | None, num_blocks: int | None,
                      num_tokens: int | None, countable: np.ndarray | None,
                      trim: bool) -> tuple[int, int, int, int | None]:
    """``_take_plain`` in numpy, the counts from ``counts(blocks)`` (None: no ref_count) and
    the references taken so far in ``_scratch`` (entries to reset added to ``touched``).
    """
    rev = segs[::-1]  # tail first
    blocks = rev[:, 0].astype(np.int64)
    self._grow(int(blocks.max()) + 1)
    stop = np.zeros(blocks.shape, bool)
    cum_tokens = tokens + np.cumsum(rev[:, 2], dtype=np.int64)
    if num_tokens is not None:
      stop |= cum_tokens >= num_tokens
    k = blocks.shape[0]
    if counts is None:
      if trim and stop.any():
        k = int(np.argmax(stop)) + 1
      np.add.at(self._scratch, blocks[:k], 1)
      touched.append(blocks[:k])
      return k, blocks.shape[0], int(cum_tokens[k - 1]), freed
    rc = counts(blocks)
    if np.unique(blocks).shape[0] == blocks.shape[0]:
      repeat = 0
    else:  # a block held twice by this node: count its references in order
      seen: dict[int, int] = {}
      repeat = np.zeros(blocks.shape, np.int64)
      for j, b in enumerate(blocks.tolist()):
        repeat[j] = seen.get(b, 0)
        seen[b] = repeat[j] + 1
    left = rc - (self._scratch[blocks] + repeat + 1)
    if (left < 0).any():
      b = int(blocks[np.argmax(left < 0)])
      raise RefCountMismatchError(
          f"ref_count[{b}]={int(rc[np.argmax(left < 0)])} is below the tree's "
          f"references on it")
    now_free = left == 0
    if countable is not None:
      now_free &= countable[blocks]
    cum_freed = freed + np.cumsum(now_free, dtype=np.int64)
    if num_blocks is not None:
      stop |= cum_freed >= num_blocks
    if trim and stop.any():
      k = int(np.argmax(stop)) + 1
    taken = blocks[:k]
    np.add.at(self._scratch, taken, 1)
    touched.append(taken)
    return k, blocks.shape[0], int(cum_tokens[k - 1]), int(cum_freed[k - 1])

  @staticmethod
  def _take_plain(segs: np.ndarray, pending: dict[int, int], tokens: int, freed: int | None,
                  num_blocks: int | None, ref_count: np.ndarray | None,
                  num_tokens: int | None, countable: np.ndarray | None,
                  trim: bool) -> tuple[int, int, int, int | None]:
    """One node of ``select`` with a host ``ref_count`` (or none), in plain Python.

    Takes segments tail first, each one reference (``pending`` counts this selection's,
    per block); returns ``(k, num_segments, tokens, freed)`` after the ``k`` taken.
    Raises ``RefCountMismatchError`` when a count is below the tree's references.
    """
    rows = segs.tolist()
    rows.reverse()
    n = len(rows)
    if ref_count is not None:
      blocks = [r[0] for r in rows]
      top = max(blocks)
      if top >= ref_count.shape[0]:
        raise RefCountMismatchError(f"tree references block {top} but ref_count has "
                                    f"{ref_count.shape[0]} entries")
      rc = ref_count[blocks].tolist()
      dyn = countable[blocks].tolist() if countable is not None else None
      seen: dict[int, int] = {}
      lefts = []
      for b, r in zip(blocks, rc):
        before = seen.get(b, 0)
        seen[b] = before + 1
        left = r - (pending.get(b, 0) + before + 1)
        if left < 0:
          raise RefCountMismatchError(f"ref_count[{b}]={r} is below the tree's references on it")
        lefts.append(left)
    k = n
    for j in range(n):
      tokens += rows[j][2]
      stop = num_tokens is not None and tokens >= num_tokens
      if ref_count is not None:
        if lefts[j] == 0 and (dyn is None or dyn[j]):
          freed += 1
        stop = stop or (num_blocks is not None and freed >= num_blocks)
      if trim and stop:
        k = j + 1
        break
    for r in rows[:k]:
      pending[r[0]] = pending.get(r[0], 0) + 1
    return k, n, tokens, freed

  def _grow(self, size: int) -> None:
    """Makes the per-block scratch arrays cover block ids below ``size``."""
    old = self._scratch.shape[0]
    if old < size:
      new = max(size, 2 * old)
      self._scratch = np.concatenate([self._scratch, np.zeros(new - old, np.int64)])
      self._known = np.concatenate([self._known, np.full(new - old, -1, np.int64)])

  def check_targets(self, num_blocks: int | None, ref_count: Any, num_tokens: int | None,
                    countable: Any) -> tuple[Any, np.ndarray | None]:
    """Validates an eviction's targets; returns ``ref_count`` and ``countable`` checked.

    Raises ``ValueError`` or ``RefCountMismatchError``.
    """
    if (num_blocks is None) == (num_tokens is None):
      raise ValueError("give exactly one of num_blocks (with ref_count) or " "num_tokens")
    if num_blocks is not None:
      if ref_count is None:
        raise ValueError(
            "num_blocks needs the pool's ref_count to know which " "decrefs free a block"
        )
      if num_blocks < 0:
        raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
    if num_tokens is not None and num_tokens < 0:
      raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    rc = self.check_ref_count(ref_count) if ref_count is not None else None
    if countable is None:
      return rc, None
    mask = np.asarray(countable)
    if mask.dtype != np.bool_ or mask.ndim != 1 or (
        rc is not None and not callable(rc) and mask.shape != rc.shape):
      raise ValueError(f"countable must be a bool[num_blocks] mask like ref_count, got "
                       f"{mask.dtype}{mask.shape}")
    return rc, mask

  def evictable(self, now: float, *, bytes_per_token: int = 0,
                ref_count: Any = None) -> EvictableReport:
    """``PrefixCache.evictable`` at time ``now``."""
    nodes = tokens = segments = marked = 0
    blocks = []
    for node in self.tree.nodes():
      if node.gc_marked:
        marked += node.num_tokens
      if node.lock_ref == 0 and not node.is_pinned(now):
        nodes += 1
        tokens += node.num_tokens
        segments += node.value.shape[0]
        blocks.append(node.value[:, 0])
    num_blocks = None
    if ref_count is not None:
      rc = self.check_ref_count(ref_count)
      d = RefDeltas.from_pairs(np.concatenate(blocks) if blocks else EMPTY_IDS, 1)
      if callable(rc):
        held = np.asarray(rc(d.block_ids.astype(np.int64))).reshape(-1) if len(d) else EMPTY_IDS
      else:
        if d.block_ids.size and int(d.block_ids.max()) >= rc.shape[0]:
          raise RefCountMismatchError("tree references a block beyond ref_count")
        held = rc[d.block_ids]
      num_blocks = int(np.count_nonzero(held == d.deltas))
    return EvictableReport(
        nodes, tokens, segments, tokens * int(bytes_per_token), num_blocks, marked
    )

"""`ChangeLog`: what the host mirror changed since the last commit, for the device.

The host decides (which block, slot, row); the device applies the decisions in
one jitted program per flush (`paged_kv.core.commit.commit`). Since the last
flush the log holds the touched blocks (ids only, repeats allowed) and rows
with their values before the window, the K/V page work in the order the device
must run it (whole-block moves, then slot-range copies), the blocks freed (to
scrub), and the mirror's totals after the previous commit (`expected`).

`batches(host)` packs it into commits carrying the touched entries' *final*
values (so the order of the host's operations does not matter), the page work,
and the "before" values the device compares with what it holds (on a mismatch
the commit applies nothing and reports it). Widths come from a small fixed set
(`CommitWidths.for_config`), so the commit programs are few; a larger window is
split into several commits (page work in the first).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import numpy as np

from paged_kv.core.commit import CommitLayout, PackedCommit
from paged_kv.core.config import PoolConfig
from paged_kv.pool.ids import distinct_mask

if TYPE_CHECKING:
  from paged_kv.pool.host_state import HostState


MIN_MOVE_WIDTH = 64


def _distinct(ids: np.ndarray) -> np.ndarray:
  """The distinct values of `ids` (`np.unique` without its cost on a few ids)."""
  if ids.size <= 32:
    return ids if ids.size == 1 else np.array(sorted(set(ids.tolist())), np.int64)
  return np.unique(ids)


def _pow2(x: int, low: int = 1) -> int:
  return 1 << max(int(x) - 1, int(low) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True)
class CommitWidths:
  """The static widths of one commit program.

  Attributes:
    blocks: touched blocks per commit (a larger window is split).
    rows: touched rows (`small_rows` or `max_seqs`).
    copies: slot-range copies (0 or `rows`).
    moves: block moves (0, or one of `move_buckets`).
  """

  blocks: int
  rows: int
  copies: int
  moves: int

  @staticmethod
  def block_width(config: PoolConfig) -> int:
    """Touched blocks per commit: room for 8 blocks per row, and for two full
    sequences (`2 * max_segments`: a long request's blocks and what its admission
    evicts); at least 1,024, at most 16,384 (a wider window splits)."""
    return int(min(16384, max(1024, _pow2(max(config.max_seqs * 8,
                                               2 * config.max_segments)))))

  @staticmethod
  def small_rows(config: PoolConfig) -> int:
    return int(min(config.max_seqs, 32))

  @staticmethod
  def move_buckets(config: PoolConfig) -> list[int]:
    """Move widths: 64, 512, 4096, ... (x8) up to the most moves a plan can hold
    (`num_blocks // 2`, rounded up to a power of two), that one included; a width
    at least half of that one is left out (the last pads at most 2x: one program less)."""
    cap = _pow2(max(config.num_blocks // 2, 1), MIN_MOVE_WIDTH)
    out, w = [], MIN_MOVE_WIDTH
    while 2 * w < cap:
      out.append(w)
      w *= 8
    return out + [cap]

  @classmethod
  def for_counts(cls, config: PoolConfig, *, rows: int, copies: int,
                 moves: int) -> "CommitWidths":
    """The widths of a window: the smallest row width that holds its rows and copies
    (a window with moves: every row, since a move rewrites any row on its block),
    the smallest move bucket that holds its moves."""
    small = cls.small_rows(config)
    r = small if max(rows, copies) <= small and not moves else config.max_seqs
    m = min(b for b in cls.move_buckets(config) if b >= moves) if moves else 0
    return cls(blocks=cls.block_width(config), rows=r, copies=r if copies else 0, moves=m)

  @classmethod
  def all_for(cls, config: PoolConfig) -> list["CommitWidths"]:
    """Every width a pool of `config` commits with (what a warm-up compiles)."""
    k, small, full = cls.block_width(config), cls.small_rows(config), config.max_seqs
    out = [cls(blocks=k, rows=r, copies=c, moves=0)
           for r in sorted({small, full}) for c in (0, r)]
    out += [cls(blocks=k, rows=full, copies=c, moves=m)
            for m in cls.move_buckets(config) for c in (0, full)]
    return out


class ChangeLog:
  """Changes of a `HostState` since the last commit (see the module docstring).

  Args:
    config: the pool's config.
    rows: record touched rows; False for a log that only collects the touched
      blocks (a step's prediction, whose rows the device's own step writes).
  """

  def __init__(self, config: PoolConfig, *, rows: bool = True):
    self.config = config
    self.records_rows = rows
    self._rmask = np.zeros(config.max_seqs, bool)
    self._block_width: int | None = None
    # What the device holds of every block's (ref_count, slots): the mirror's values
    # as of the last commit (None until a host is attached; see `reset`).
    self._committed_ref: np.ndarray | None = None
    self._committed_slots: np.ndarray | None = None
    self._widths: dict[tuple[int, int, int], CommitWidths] = {}  # `batches`' widths by counts
    self.reset(None)

  def reset(self, host: "HostState | None") -> None:
    """Empties the log; `host`'s values become what the device is expected to hold
    (after a flush: the window's blocks; a new or reloaded host: every block).
    `None`: the device's values are unknown until the next `reset(host)`."""
    if host is None:
      self._committed_ref = self._committed_slots = None
    elif (self._committed_ref is None
          or self._committed_ref.shape[0] != host.ref_count.shape[0]):
      self._committed_ref = host.ref_count.copy()
      self._committed_slots = host.slots.copy()
    else:
      if getattr(self, "_num_touched", 0):
        ids = self.touched_blocks(host)
        self._committed_ref[ids] = host.ref_count[ids]
        self._committed_slots[ids] = host.slots[ids]
      self._settle_grown(host)
    self._grown: list[np.ndarray] = []  # tail blocks the next step grows on the device
    self._grown_tokens = 0  # their tokens, not in `expected` yet
    for ids in getattr(self, "_rows", ()):
      self._rmask[ids] = False
    if not hasattr(self, "_touched"):
      self._touched = np.empty(1024, np.int64)  # the window's touched ids, repeats kept
    self._num_touched = 0  # entries of `_touched` in use
    self._distinct: np.ndarray | None = None  # `touched_blocks`' answer, until a touch
    self._rows: list[np.ndarray] = []
    self._old_rows: list[np.ndarray] = []
    self._zero_before: set[int] = set()  # scrub: freed before any page write of the window
    self._zero_after: set[int] = set()  # scrub: freed after the window's page write to it
    self._copies: list[np.ndarray] = []
    self._moves: list[np.ndarray] = []
    self._page_dst: set[int] = set()
    self.num_blocks = 0  # touched entries, repeats counted (an upper bound)
    self.num_rows = 0
    self.num_copies = 0
    self.num_moves = 0
    self.num_freed = 0
    self.expected = None if host is None else host.totals()

  def resize(self, config: PoolConfig) -> None:
    """Follows a pool resize (the log must be empty; the next `reset(host)` copies
    the resized host's values as the device's)."""
    assert not self.pending, "resize with pending changes"
    self.config = config
    self._committed_ref = self._committed_slots = None
    self._block_width = None
    self._widths = {}

  # ------------------------------------------------------------------ recording
  @property
  def pending(self) -> bool:
    return bool(self.num_blocks or self.num_rows or self.num_copies or self.num_moves)

  def touch_blocks(self, host: "HostState", ids: np.ndarray, *, distinct: bool = False) -> None:
    """Records that `ids` (repeats allowed) are about to change; their values before
    the window are the committed ones, so a touch is one copy into the window's
    buffer of touched ids."""
    del host, distinct
    self.touch_owned(np.asarray(ids, np.int64).reshape(-1))

  def touch_owned(self, ids: np.ndarray) -> None:
    """`touch_blocks` of an `i64[k]` array (copied into the buffer)."""
    k = ids.size
    if k:
      n = self._num_touched
      if n + k > self._touched.shape[0]:
        grown = np.empty(max(2 * self._touched.shape[0], n + k), np.int64)
        grown[:n] = self._touched[:n]
        self._touched = grown
      self._touched[n:n + k] = ids
      self._num_touched = n + k
      self._distinct = None
      self.num_blocks += k

  def adopt(self, host: "HostState", ids: np.ndarray) -> None:
    """Blocks a jitted step changed on the device as the host predicted: their
    current host values are the device's now; they are checked at the next commit."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ids.size and self._committed_ref is not None:
      self._committed_ref[ids] = host.ref_count[ids]
      self._committed_slots[ids] = host.slots[ids]
    self.touch_blocks(host, ids)

  def touch_row(self, host: "HostState", row: int) -> None:
    """`touch_rows` of one row."""
    if self.records_rows and not self._rmask[row]:
      self._rmask[row] = True
      self._rows.append(np.array([row], np.int64))
      self._old_rows.append(np.array([[host.num_segments[row], host.seq_len[row],
                                       host.active[row]]], np.int64))
      self.num_rows += 1

  def rows_logged(self, rows: np.ndarray) -> np.ndarray:
    """`bool[R]`: which of `rows` the window already holds (their commit writes
    their final values)."""
    return self._rmask[rows]

  def device_growth(self, blocks: np.ndarray, tokens: int) -> None:
    """In-place growth the next step applies on the device (`HostState.grow_in_place`):
    `blocks`' slots there become the host's, and `tokens` more are live."""
    self._grown.append(blocks)
    self._grown_tokens += tokens

  def settle_growth(self, host: "HostState") -> None:
    """After the flush before the step that applies the growth: the grown blocks'
    committed slots are the host's, and `expected` counts the tokens and the step's
    clock (a flush's reset already took all from the host)."""
    if self._grown:
      self._settle_grown(host)
      if self.expected is not None:
        self.expected[2] += self._grown_tokens
        self.expected[4] = host.step
      self._grown = []
      self._grown_tokens = 0

  def _settle_grown(self, host: "HostState") -> None:
    grown = getattr(self, "_grown", None)
    if grown and self._committed_slots is not None:
      ids = grown[0] if len(grown) == 1 else np.concatenate(grown)
      self._committed_slots[ids] = host.slots[ids]

  def touch_rows(self, host: "HostState", rows: np.ndarray) -> None:
    if not self.records_rows:
      return
    rows = np.asarray(rows, np.int64)
    new = rows[~self._rmask[rows]]
    if new.size:
      new = _distinct(new)
      self._rmask[new] = True
      self._rows.append(new)
      self._old_rows.append(np.stack([host.num_segments[new], host.seq_len[new],
                                      host.active[new].astype(np.int32)], axis=1))
      self.num_rows += new.size

  def freed(self, ids: np.ndarray) -> None:
    """Blocks that became free (zeroed by the commit when the pool scrubs): after the
    window's page work when the window wrote into them before they freed, else before
    its writes (and after its reads)."""
    if self.config.scrub_freed_blocks:
      for b in np.asarray(ids, np.int64).tolist():
        (self._zero_after if b in self._page_dst else self._zero_before).add(b)
      self.num_freed += len(ids)

  def copies(self, host: "HostState", rows: np.ndarray) -> None:
    """Slot-range copies `[C, 5]` rows `(src_block, src_start, dst_block, dst_start, len)`."""
    del host
    if len(rows):
      self._copies.append(rows)
      self.num_copies += len(rows)
      self._page_dst.update(rows[:, 2].tolist())

  def moves(self, host: "HostState", pairs: np.ndarray) -> None:
    """Block moves `[M, 2]` rows `(src, dst)`; must come before any copy of the window."""
    del host
    if len(pairs):
      assert not self.num_copies, "block moves after copies in one window: flush first"
      self._moves.append(pairs)
      self.num_moves += len(pairs)
      self._page_dst.update(pairs[:, 1].tolist())

  def page_conflict(self, sources, dests=(), *, moves: bool = False,
                    copies: int = 0) -> bool:
    """Whether page work reading `sources` and writing `dests` (`copies` more slot
    copies) must wait for a flush.

    A commit reads every source before it writes, runs moves before copies and
    holds at most `max_seqs` copies; with scrubbing, a block freed in the window
    is zeroed after the reads. So a window may not touch a block an earlier page
    op wrote, nor move after a copy, nor read a freed block again.
    """
    src = np.asarray(sources, np.int64).reshape(-1)
    dst = np.asarray(dests, np.int64).reshape(-1)
    if (moves and self.num_copies) or self.num_copies + copies > self.config.max_seqs:
      return True
    if self._page_dst and any(int(b) in self._page_dst for b in np.concatenate([src, dst])):
      return True
    if self.config.scrub_freed_blocks:
      if self.num_freed >= CommitWidths.block_width(self.config) // 2:
        return True
      if self._zero_before and any(int(b) in self._zero_before for b in src):
        return True
    return False

  def touched_blocks(self, host: "HostState") -> np.ndarray:
    """`i64[K]`: the blocks touched in the window, each once (order unspecified)."""
    if self._distinct is None:
      ids = self._touched[:self._num_touched]
      self._distinct = ids[distinct_mask(host.stamp, ids)] if ids.size > 1 else ids.copy()
    return self._distinct

  def free_page_dsts(self, host: "HostState") -> np.ndarray:
    """Blocks the window wrote into that are free again (a new allocation may pick
    one: page work into it must wait for a flush)."""
    if not self._page_dst:
      return np.zeros(0, np.int64)
    d = np.fromiter(self._page_dst, np.int64)
    return d[host.ref_count[d] == 0]

  @property
  def wants_flush(self) -> bool:
    """The window is as large as one commit should be: flush at the next boundary."""
    if self._block_width is None:
      self._block_width = CommitWidths.block_width(self.config)
    return self.num_blocks >= 4 * self._block_width

  # ------------------------------------------------------------------ to the device
  def batches(self, host: "HostState") -> list[PackedCommit]:
    """The window as packed commits (host buffers; one per block chunk)."""
    c = self.config
    w = c.slot_words
    blocks = self.touched_blocks(host)
    if self._committed_ref is None:
      raise RuntimeError("ChangeLog.batches: no committed values (reset(host) first)")
    old_ref = self._committed_ref[blocks]
    old_slots = self._committed_slots[blocks]
    scrub = None  # bool[K, 2]: zero before / after the page writes (scrubbing pools)
    if self._zero_before or self._zero_after:
      scrub = np.zeros((blocks.size, 2), bool)
      scrub[:, 0] = np.isin(blocks, list(self._zero_before))
      scrub[:, 1] = np.isin(blocks, list(self._zero_after))
      order = np.argsort(~scrub.any(axis=1), kind="stable")  # scrubbed: in the first chunk
      blocks, old_ref, old_slots, scrub = blocks[order], old_ref[order], old_slots[order], \
          scrub[order]
    rows = np.concatenate(self._rows) if self._rows else np.zeros(0, np.int64)
    old_rows = np.concatenate(self._old_rows) if self._old_rows else np.zeros((0, 3), np.int64)
    copies = np.concatenate(self._copies) if self._copies else np.zeros((0, 5), np.int64)
    moves = np.concatenate(self._moves) if self._moves else np.zeros((0, 2), np.int64)
    key = (rows.size, len(copies), len(moves))
    widths = self._widths.get(key)
    if widths is None:
      widths = CommitWidths.for_counts(c, rows=rows.size, copies=len(copies), moves=len(moves))
      if not len(moves):  # a few row and copy counts: cached
        self._widths[key] = widths
    assert rows.size <= widths.rows and len(copies) <= widths.copies
    k = widths.blocks
    chunks = max(1, -(-blocks.size // k))
    assert scrub is None or scrub.any(axis=1).sum() <= k, "scrubbed blocks beyond one commit"
    out = []
    expected = self.expected if self.expected is not None else host.totals()
    for i in range(chunks):
      sl = slice(i * k, (i + 1) * k)
      ids = blocks[sl]
      first = i == 0
      out.append(_batch(
          host, widths if first else dataclasses.replace(widths, copies=0, moves=0),
          ids, old_ref[sl], old_slots[sl], None if scrub is None else scrub[sl],
          rows if first else rows[:0], old_rows if first else old_rows[:0],
          copies if first else copies[:0], moves if first else moves[:0],
          expected if first else None))
    return out


def empty_batch(host: "HostState", widths: CommitWidths) -> PackedCommit:
  """A commit of `widths` that changes nothing (all padding, no checks): warm-up."""
  layout = _layout(host.config, widths)
  buf = layout.template.copy()
  layout.put(buf, "step", host.step)
  return PackedCommit(buf, layout)


def _layout(config: PoolConfig, widths: CommitWidths) -> CommitLayout:
  """One layout object per widths (its offsets and template are computed once)."""
  return _layout_of(widths.blocks, widths.rows, widths.copies, widths.moves,
                    config.slot_words, config.max_segments)


@functools.lru_cache(maxsize=64)
def _layout_of(blocks: int, rows: int, copies: int, moves: int, slot_words: int,
               max_segments: int) -> CommitLayout:
  """`_layout`, cached by plain ints (hashing a whole config costs more)."""
  return CommitLayout(blocks=blocks, rows=rows, copies=copies, moves=moves,
                      slot_words=slot_words, max_segments=max_segments)


def _batch(host: "HostState", widths: CommitWidths, ids, old_ref, old_slots, scrub, rows,
           old_rows, copies, moves, expected) -> PackedCommit:
  """One packed commit: each run of same-shaped fields written through one view
  (`CommitLayout.group`); ids and counts cast to `i32`, slot words bit for bit."""
  layout = _layout(host.config, widths)
  buf = layout.template.copy()
  n = len(ids)
  if n:
    v = layout.group(buf, "blocks")
    v[0, :n] = ids
    v[1, :n] = old_ref
    v[2, :n] = host.ref_count[ids]
    v = layout.group(buf, "slots")
    k = n * layout.slot_words
    v[0, :k] = old_slots.reshape(-1).view(np.int32)
    v[1, :k] = host.slots[ids].reshape(-1).view(np.int32)
    if scrub is not None and scrub.any():
      layout.group(buf, "scrub")[:, :n] = scrub.T
  r = len(rows)
  if r:
    v = layout.group(buf, "rows_before")
    v[0, :r] = rows
    v[1:, :r] = old_rows.T
    v = layout.group(buf, "row_segments")
    k = r * layout.max_segments
    v[0, :k] = host.block[rows].reshape(-1)
    v[1, :k] = host.start[rows].reshape(-1)
    v[2, :k] = host.length[rows].reshape(-1)
    v = layout.group(buf, "rows_after")
    v[0, :r] = host.num_segments[rows]
    v[1, :r] = host.seq_len[rows]
    v[2, :r] = host.active[rows]
  if len(copies):
    layout.group(buf, "copies")[:, :len(copies)] = copies.T
  if len(moves):
    layout.group(buf, "moves")[:, :len(moves)] = moves.T
  if expected is not None:
    layout.put(buf, "expected", expected)
    layout.put(buf, "check_totals", 1)
  layout.put(buf, "step", host.step)
  return PackedCommit(buf, layout)

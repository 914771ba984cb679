"""The one invariant checker (host side, numpy), used by every test and soak run.

Checks reference counts, slot bitmaps, segment bounds, sequence lengths and the
free index, counting references held outside the tables (prefix-cache nodes).
Invariants about data (no slot written twice, K/V unchanged by moves) belong to
the stateful tests.
"""

from __future__ import annotations

import jax
import numpy as np

from paged_kv.core.errors import InvalidArgument, InvariantViolation
from paged_kv.core.segment_format import Segments, as_segments
from paged_kv.core.state import FREE_FANOUT, REGION_DYNAMIC, PoolState, free_index_levels


def _slot_bits(words: np.ndarray, block_size: int) -> np.ndarray:
  i = np.arange(block_size)
  return ((words[..., i // 32] >> (i % 32).astype(np.uint32)) & 1).astype(bool)


def _free_index_errors(meta, free: np.ndarray) -> list[str]:
  """Violations of the free index (`free_bits`, `free_counts`, `num_free`) against `free`."""
  errors = []
  n = free.shape[0]
  sizes, offsets = free_index_levels(n)
  f = FREE_FANOUT
  words = np.asarray(meta.free_bits).astype(np.uint32)
  counts = np.asarray(meta.free_counts).astype(np.int64)
  if words.shape != (sizes[0],) or counts.shape != (max(1, sum(sizes[1:])),):
    return [f"free index shapes {words.shape}, {counts.shape} do not fit {n} blocks"]
  bits2d = ((words[:, None] >> np.arange(f, dtype=np.uint32)[None, :]) & 1).astype(bool)
  bits = bits2d.reshape(-1)
  want = free & (np.asarray(meta.region) == REGION_DYNAMIC)
  if bits[n:].any():
    errors.append("free index marks blocks beyond num_blocks")
  listed = bits[:n]
  if not np.array_equal(listed, want):
    ghost = np.flatnonzero(want & ~listed)
    booked = np.flatnonzero(listed & ~want)
    errors.append(f"free index != free dynamic blocks: {ghost[:10].tolist()} free but not "
                  f"listed (ghosts), {booked[:10].tolist()} listed but referenced or in the "
                  "base region (double-booked)")
  level = bits2d.sum(axis=1, dtype=np.int64)
  for lv in range(1, len(sizes)):
    padded = np.zeros(sizes[lv] * f, np.int64)
    padded[:level.size] = level
    level = padded.reshape(sizes[lv], f).sum(axis=1)
    got = counts[offsets[lv]:offsets[lv] + sizes[lv]]
    if not np.array_equal(got, level):
      errors.append(f"free index count level {lv} disagrees with the bitmap")
  nf = int(meta.num_free)
  if nf != int(listed.sum()):
    errors.append(f"num_free {nf} != {int(listed.sum())} blocks in the free index")
  return errors


def check_invariants(state: PoolState, extra_segments: Segments | None = None, *,
                     extra_blocks=None, raise_on_error: bool = True) -> list[str]:
  """Checks the pool's invariants; returns the violations (raises if any, by default).

  `extra_segments: i32[n, 3]` and `extra_blocks: int[k]` are the references held
  outside the tables, one each (a prefix cache's segments; blocks a caller of
  `allocate()` holds without a segment). Layout errors raise
  `InvalidSegmentLayout` / `InvalidArgument` whatever `raise_on_error` says.
  """
  extra = None if extra_segments is None else as_segments(extra_segments,
                                                          name="extra_segments")
  meta = jax.tree.map(np.asarray, state.meta)
  table = jax.tree.map(np.asarray, state.table)
  n, bs = meta.ref_count.shape[0], state.pages.k.shape[3]
  errors: list[str] = []

  segs = []  # (block, start, length, owner)
  m = table.block.shape[1]
  for i in range(table.active.shape[0]):
    ns = int(table.num_segments[i])
    if not table.active[i]:
      if ns or table.seq_len[i] or table.length[i].any():
        errors.append(f"inactive row {i} has segments or length")
      continue
    if not 0 <= ns <= m:
      errors.append(f"row {i}: num_segments {ns} out of [0, {m}]")
      continue
    if table.length[i, ns:].any():
      errors.append(f"row {i}: non-zero length beyond num_segments")
    if int(table.length[i, :ns].sum()) != int(table.seq_len[i]):
      errors.append(f"row {i}: seq_len {table.seq_len[i]} != sum of lengths "
                    f"{table.length[i, :ns].sum()}")
    for s in range(ns):
      segs.append((int(table.block[i, s]), int(table.start[i, s]), int(table.length[i, s]),
                   f"seq {i} seg {s}"))
  if extra is not None:
    for j, (b, st, ln) in enumerate(extra.astype(np.int64)):
      segs.append((int(b), int(st), int(ln), f"extra {j}"))

  expected = np.zeros(n, np.int64)
  if extra_blocks is not None:
    eb = np.asarray(extra_blocks)
    if eb.ndim > 1 or (eb.size and (eb.dtype == np.bool_ or
                                    not np.issubdtype(eb.dtype, np.integer))):
      raise InvalidArgument(f"extra_blocks must be a 1-D array of block ids, got {eb.dtype} "
                            f"{eb.shape}")
    eb = eb.reshape(-1).astype(np.int64) if eb.size else np.zeros(0, np.int64)
    outside = (eb < 0) | (eb >= n)
    if outside.any():
      errors.append(f"extra_blocks {eb[outside][:10].tolist()} out of range")
    np.add.at(expected, eb[~outside], 1)
  bits = _slot_bits(meta.slots, bs)
  for b, st, ln, owner in segs:
    if not 0 <= b < n:
      errors.append(f"{owner}: block {b} out of range")
      continue
    expected[b] += 1
    if ln < 1 or st < 0 or st + ln > bs:
      errors.append(f"{owner}: segment ({b}, {st}, {ln}) outside its block")
      continue
    if not bits[b, st:st + ln].all():
      errors.append(f"{owner}: slots [{st}, {st + ln}) of block {b} not marked used")

  bad = np.nonzero(expected != meta.ref_count)[0]
  for b in bad[:10]:
    errors.append(f"block {b}: ref_count {meta.ref_count[b]} != references {expected[b]}")
  if (meta.ref_count < 0).any():
    errors.append("negative ref_count")
  free = meta.ref_count == 0
  if bits[free].any():
    errors.append(f"free blocks with slot bits set: {np.nonzero(free & bits.any(1))[0][:10]}")
  errors.extend(_free_index_errors(meta, free))
  if errors and raise_on_error:
    raise InvariantViolation("; ".join(errors[:20]))
  return errors

"""The pool's transitions on the host mirror: same statuses, same results as the device.

Each function is the numpy twin of the jitted transition in `paged_kv.core` its
docstring names, run on a `HostState`: the same status codes in the same order
of precedence and, when it applies, the same end state (`tests/pool/` runs
both on random operation sequences and compares every array). Refused calls
change nothing. `reserve` decides the scheduler's step (`BlockPool.reserve_step`)
and predicts the k-step decode's own `reserve_tokens`, so the host knows a step's
slots without reading the device.
"""

from __future__ import annotations

import numpy as np

from paged_kv.core import compact
from paged_kv.core.errors import Status
from paged_kv.core.state import REGION_BASE, REGION_DYNAMIC
from paged_kv.pool.host_state import HostState
from paged_kv.pool.ids import arange, distinct_mask, sum_by_id, words_to_int

_I32_MAX = np.iinfo(np.int32).max
# Status codes as plain ints (numpy compares an IntEnum member more slowly).
_OK, _ABORTED = int(Status.OK), int(Status.ABORTED)
_INVALID_SEQUENCE, _INVALID_COUNT = int(Status.INVALID_SEQUENCE), int(Status.INVALID_COUNT)
_INVALID_BLOCK, _INVALID_SEGMENT = int(Status.INVALID_BLOCK), int(Status.INVALID_SEGMENT)
_TABLE_FULL, _NO_FREE_BLOCK = int(Status.TABLE_FULL), int(Status.NO_FREE_BLOCK)
_REF_UNDERFLOW, _REF_OVERFLOW = int(Status.REF_UNDERFLOW), int(Status.REF_OVERFLOW)
_BLOCK_IN_USE = int(Status.BLOCK_IN_USE)
# Non-atomic reservations of more rows than this try the in-place decode path first.
DECODE_FAST_MIN = 8
# Rows the decode path leaves, up to this many, are reserved one at a time in plain Python.
SMALL_RESERVE = 16
# Reference deltas of at most this many entries take the plain-Python path.
SMALL_DELTAS = 32


def _clamp(x, lo: int, hi: int):
  """`np.clip` for int arrays without its per-call overhead."""
  return np.minimum(np.maximum(x, lo), hi)


def _cdiv(a, b):
  return -(-a // b)


def first_occurrence(ids: np.ndarray) -> np.ndarray:
  """`bool[B]`: True at the first occurrence of each value."""
  ids = np.asarray(ids)
  out = np.zeros(ids.shape, bool)
  if ids.size <= 32:  # small batches: a set beats a sort
    seen = set()
    for i, v in enumerate(ids.tolist()):
      if v not in seen:
        seen.add(v)
        out[i] = True
    return out
  _, first = np.unique(ids, return_index=True)
  out[first] = True
  return out


def row_status(h: HostState, ids: np.ndarray, *, want_active: bool) -> np.ndarray:
  """`sequences.row_status`: in range, (in)active as wanted, not repeated; -1 OK."""
  s = h.config.max_seqs
  in_range = (ids >= 0) & (ids < s)
  active = h.active[_clamp(ids, 0, s - 1)]
  good = in_range & (active == want_active) & first_occurrence(ids)
  return np.where(ids == -1, _OK,
                  np.where(good, _OK, _INVALID_SEQUENCE)).astype(np.int32)


def grant_prefix(need: np.ndarray, ok: np.ndarray, num_free: int, *,
                 atomic: bool) -> np.ndarray:
  """`alloc.grant_prefix`: first come first served, prefix-greedy."""
  need = np.where(ok, need, 0)
  granted = ok & ((need == 0) | (np.cumsum(need) <= num_free))
  if atomic:
    granted = granted & bool(np.all(granted == ok))
  return granted


def _aborted(status: np.ndarray, applied: np.ndarray) -> np.ndarray:
  """`sequences.finish_status`."""
  return np.where((status == _OK) & ~applied, _ABORTED, status).astype(np.int32)


def slot_bits(words: np.ndarray, block_size: int) -> np.ndarray:
  i = np.arange(block_size)
  return ((words[..., i // 32] >> (i % 32).astype(np.uint32)) & 1).astype(bool)


def range_mask(start: np.ndarray, length: np.ndarray, words: int) -> np.ndarray:
  """`u32[..., words]` with bits `[start, start + length)` set (`sequences.range_mask`)."""
  if words == 1:  # blocks of <= 32 slots: one int64 shift (starts and lengths <= 32)
    s, l = np.asarray(start, np.int64), np.asarray(length, np.int64)
    return ((((np.int64(1) << l) - 1) << s) & 0xFFFFFFFF).astype(np.uint32)[..., None]
  base = 32 * np.arange(words)
  lo = _clamp(np.asarray(start)[..., None] - base, 0, 32).astype(np.uint64)
  hi = _clamp(np.asarray(start)[..., None] + np.asarray(length)[..., None] - base, 0,
               32).astype(np.uint64)
  ones = lambda k: ((np.uint64(1) << k) - np.uint64(1))
  return (ones(hi) & ~ones(lo)).astype(np.uint32)


def _take_lowest(h: HostState, need: np.ndarray, granted: np.ndarray,
                 width: int) -> np.ndarray:
  """`alloc.take_blocks`: the lowest free blocks, per granted row in order."""
  eff = np.where(granted, need, 0).astype(np.int64)
  total = int(eff.sum())
  ids = np.full((need.shape[0], max(width, 1)), -1, np.int64)
  if total == 0:
    return ids[:, :width]
  blocks = h.free.lowest(total)
  offset = np.cumsum(eff) - eff
  j = np.arange(max(width, 1))[None, :]
  used = j < eff[:, None]
  ids[used] = blocks[(offset[:, None] + j)[used]]
  h.take_blocks(blocks)
  return ids[:, :width]


# ---------------------------------------------------------------------------


def open_rows(h: HostState, ids: np.ndarray, seg_block: np.ndarray, seg_start: np.ndarray,
              seg_length: np.ndarray, num_segments: np.ndarray) -> np.ndarray:
  """`sequences.open_sequence(atomic=True)`; returns `status i32[B]`."""
  c = h.config
  n, bs, m = c.num_blocks, c.block_size, c.max_segments
  ids = np.asarray(ids, np.int64)
  b, p = seg_block.shape
  if b == 1:
    return _open_one(h, int(ids[0]), seg_block[0], seg_start[0], seg_length[0],
                     int(num_segments[0]))
  real = ids != -1
  status = row_status(h, ids, want_active=False)
  count_bad = (num_segments < 0) | (num_segments > min(p, m))
  status = np.where((status == _OK) & count_bad & real, _INVALID_COUNT, status)
  used = np.arange(p)[None, :] < num_segments[:, None]
  blk_ok = (seg_block >= 0) & (seg_block < n)
  cb = _clamp(seg_block, 0, n - 1)
  live = h.ref_count[cb] > 0
  shape_ok = (seg_start >= 0) & (seg_start < bs) & (seg_length >= 1) & (
      seg_length <= bs - seg_start)
  mask = range_mask(_clamp(seg_start, 0, bs), _clamp(seg_length, 0, bs), c.slot_words)
  written = np.all((h.slots[cb] & mask) == mask, axis=-1)
  bad_block = np.any(used & ~(blk_ok & live), axis=1)
  bad_seg = np.any(used & ~(shape_ok & written), axis=1)
  status = np.where((status == _OK) & real & bad_block, _INVALID_BLOCK, status)
  status = np.where((status == _OK) & real & bad_seg, _INVALID_SEGMENT, status)
  ok = (status == _OK) & real & bool(np.all(status == _OK))
  if ok.any():
    width = min(p, m)
    rows = ids[ok]
    used_w = used[ok, :width]
    blk = np.zeros((rows.size, m), np.int32)
    st = np.zeros((rows.size, m), np.int32)
    ln = np.zeros((rows.size, m), np.int32)
    # Columns past the given width keep their (zero) values: the rows were inactive.
    blk[:, :width] = np.where(used_w, seg_block[ok, :width], 0)
    st[:, :width] = np.where(used_w, seg_start[ok, :width], 0)
    ln[:, :width] = np.where(used_w, seg_length[ok, :width], 0)
    keep = slice(width, m)
    blk[:, keep], st[:, keep], ln[:, keep] = (h.block[rows, keep], h.start[rows, keep],
                                              h.length[rows, keep])
    h.write_rows(rows, block=blk, start=st, length=ln, num_segments=num_segments[ok],
                 seq_len=ln[:, :width].sum(axis=1), active=True)
    h.change_refs(seg_block[ok, :width][used_w], np.ones(int(used_w.sum()), np.int64))
  return _aborted(status, ok | ~real)


def dead_segments(h: HostState, seg_block: np.ndarray, seg_start: np.ndarray,
                  seg_length: np.ndarray, used: np.ndarray) -> np.ndarray:
  """`bool[B, P]`: used segments on dead slots: on a live block only the tables
  hold (`sequences.open_checked`'s suspects), on slots no live table segment
  covers, so their K/V may be handed out again (`BlockPool` refuses the open).
  """
  c = h.config
  n, bs = c.num_blocks, c.block_size
  in_range = (seg_block >= 0) & (seg_block < n)
  cb = _clamp(seg_block, 0, n - 1)
  shape_ok = (seg_start >= 0) & (seg_start < bs) & (seg_length >= 1) & (
      seg_length <= bs - seg_start)
  ref = h.ref_count[cb]
  suspect = used & in_range & shape_ok & (ref > 0) & (ref <= h.table_refs[cb])
  dead = np.zeros(suspect.shape, bool)
  if not suspect.any():
    return dead
  tu = h.used_mask()
  t_blk, t_start, t_len = h.block[tu], h.start[tu], h.length[tu]
  for r, col in zip(*np.nonzero(suspect)):
    blk, s0, ln = int(seg_block[r, col]), int(seg_start[r, col]), int(seg_length[r, col])
    covered = np.zeros(bs, bool)
    on = t_blk == blk
    for a, l in zip(t_start[on], t_len[on]):
      covered[a:a + l] = True
    dead[r, col] = not covered[s0:s0 + ln].all()
  return dead


def reserve(h: HostState, ids: np.ndarray, num_new: np.ndarray, *, max_new_tokens: int,
            atomic: bool, grow: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """`sequences.reserve_tokens`; returns `(slot_idx i32[B, T], status i32[B])`.

  With `grow` (`i32[B]` zeros: `BlockPool.reserve_step`), the decode rows that
  grow in place and are not in the log yet stay out of it, marked `grow[b] = 1`
  for the step to apply (`paged_kv.core.growth`); the mirror still changes.

  Not atomic, one-token rows take a short path first (`_decode_fast`), the rest
  the general path (row by row when few: `_reserve_rows`). The result is the
  general path's: in-place rows take no block, so the others' first-come-
  first-served grants are the same.
  """
  ids = np.asarray(ids, np.int64)
  num_new = np.asarray(num_new, np.int64)
  if ids.size == 1:
    return _reserve_one(h, int(ids[0]), int(num_new[0]), max_new_tokens)
  if not atomic and ids.size > DECODE_FAST_MIN and max_new_tokens >= 1:
    slot_idx = np.full((ids.shape[0], max_new_tokens), -1, np.int32)
    rest = _decode_fast(h, ids, num_new, slot_idx, grow)
    if rest is not None:
      status = np.zeros(ids.shape, np.int32)  # OK
      step = h.step
      if rest.size > SMALL_RESERVE:
        slot_idx[rest], status[rest] = _reserve(h, ids[rest], num_new[rest],
                                                max_new_tokens=max_new_tokens, atomic=False)
      elif rest.size:
        slot_idx[rest], status[rest] = _reserve_rows(h, ids[rest].tolist(),
                                                     num_new[rest].tolist(), max_new_tokens)
      h.step = step + 1  # the short path placed a token: the clock moves once per reservation
      return slot_idx, status
  return _reserve(h, ids, num_new, max_new_tokens=max_new_tokens, atomic=atomic)


def _decode_fast(h: HostState, ids: np.ndarray, num_new: np.ndarray,
                 slot_idx: np.ndarray, grow: np.ndarray | None = None) -> np.ndarray | None:
  """The short path of a non-atomic reservation's one-token rows (see `reserve`).

  Writes the applied rows' slots into `slot_idx[:, 0]`; returns the batch
  positions of the rows left (padding excluded), or None when it applied none.
  A valid, active, unrepeated one-token row grows in place when its tail block
  is exclusive and dynamic with the next slot free (as the general path would);
  else, with room in its table, it takes a fresh block, applied only when all
  such rows come before every other row and the free blocks suffice.
  """
  c = h.config
  bs, m, s, w = c.block_size, c.max_segments, c.max_seqs, c.slot_words
  one = (num_new == 1) & (ids >= 0) & (ids < s)
  if not one.any():
    return None
  row = np.where(one, ids, 0)
  one &= h.active[row]
  one &= ~_repeated(ids)
  ns = h.num_segments[row]
  tail = np.maximum(ns - 1, 0)  # num_segments <= max_segments
  tb = h.tail_block[row]  # the rows' tail facts, kept by the mirror (`HostState.row_tails`)
  pos = h.tail_end[row]
  room = (h.tail_limit[row] > pos) & (h.ref_count[tb] == 1)
  in_place = one & room
  fresh = one & ~room & (ns < m)
  other = (ids != -1) & ~in_place & ~fresh
  nf = int(np.count_nonzero(fresh))
  if nf and (nf > h.free.num_free or (other.any() and int(np.flatnonzero(fresh)[-1])
                                                      > int(other.argmax()))):
    other |= fresh  # the general path decides their grants
    nf = 0
  ip = np.flatnonzero(in_place)
  if not ip.size and not nf:
    return None
  if ip.size:
    b, p = tb[ip], pos[ip]
    slot_idx[ip, 0] = b * bs + p
    if grow is not None:
      dev = ~h.log.rows_logged(row[ip])
      if dev.all():
        h.grow_in_place(row[ip], tail[ip], b, p)
        grow[ip] = 1
        ip = ip[:0]
      elif dev.any():
        d = ip[dev]
        h.grow_in_place(row[d], tail[d], b[dev], p[dev])
        grow[d] = 1
        ip, b, p = ip[~dev], b[~dev], p[~dev]
  if ip.size:
    h.set_slot_bits(b, p)
    h.grow_tails(row[ip], tail[ip])
  if nf:
    g = np.flatnonzero(fresh)  # ascending: the lowest free blocks in batch order
    new = h.free.lowest(nf)
    h.take_blocks(new, _prefix_words(1, w))
    h.start_tails(row[g], ns[g], new)
    slot_idx[g, 0] = new * bs
  return np.flatnonzero(other)


def _repeated(ids: np.ndarray) -> np.ndarray:
  """`bool[B]`: the entries whose id occurs more than once in the batch."""
  if ids.size <= 32:
    seen, twice = set(), set()
    for v in ids.tolist():
      (twice if v in seen else seen).add(v)
    return np.array([v in twice for v in ids.tolist()], bool)
  lo = int(ids.min())
  if lo >= -1 and int(ids.max()) < 1 << 20:  # row ids: a count per value, no sort
    counts = np.bincount(ids + 1)
    return counts[ids + 1] > 1
  _, inv, counts = np.unique(ids, return_inverse=True, return_counts=True)
  return counts[inv.reshape(-1)] > 1


def _reserve(h: HostState, ids: np.ndarray, num_new: np.ndarray, *, max_new_tokens: int,
             atomic: bool) -> tuple[np.ndarray, np.ndarray]:
  """The general path of `reserve`."""
  c = h.config
  bs, m, s = c.block_size, c.max_segments, c.max_seqs
  ids = np.asarray(ids, np.int64)
  num_new = np.asarray(num_new, np.int64)
  real = ids != -1
  status = row_status(h, ids, want_active=True)
  count_bad = (num_new < 0) | (num_new > max_new_tokens)
  status = np.where((status == _OK) & real & count_bad, _INVALID_COUNT, status)
  row = _clamp(ids, 0, s - 1)
  ns = h.num_segments[row].astype(np.int64)
  tail = _clamp(ns - 1, 0, m - 1)
  tb = h.block[row, tail].astype(np.int64)
  pos = (h.start[row, tail] + h.length[row, tail]).astype(np.int64)
  exclusive = (ns > 0) & (h.ref_count[tb] == 1) & (h.region[tb] == REGION_DYNAMIC)
  i = np.arange(bs)[None, :]
  busy = slot_bits(h.slots[tb], bs) | (i < pos[:, None])
  first_busy_after = np.min(np.where(busy & (i >= pos[:, None]), i, bs), axis=1)
  room = np.where(exclusive, first_busy_after - pos, 0)
  n_tok = _clamp(num_new, 0, max_new_tokens)
  in_place = np.minimum(n_tok, room)
  rest = n_tok - in_place
  need = _cdiv(rest, bs)
  status = np.where((status == _OK) & real & (ns + need > m), _TABLE_FULL, status)
  valid = (status == _OK) & real
  if atomic:
    valid = valid & bool(np.all(status == _OK))
  max_blocks = _cdiv(max_new_tokens, bs)
  granted = grant_prefix(need, valid, h.free.num_free, atomic=atomic)
  status = np.where(valid & ~granted, _NO_FREE_BLOCK, status)
  new_ids = _take_lowest(h, need, granted, max_blocks)
  # Slots of the granted rows' tokens, computed on the tokens only (not B x T).
  slot_idx = np.full((ids.shape[0], max_new_tokens), -1, np.int64)
  counts = np.where(granted, n_tok, 0)
  total = int(counts.sum())
  if total:
    tok_row = np.repeat(np.arange(ids.shape[0]), counts)
    j = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    k = j - in_place[tok_row]
    fresh = new_ids[tok_row, _clamp(k // bs, 0, max(max_blocks - 1, 0))] * bs + k % bs
    slots = np.where(k < 0, tb[tok_row] * bs + pos[tok_row] + j, fresh)
    slot_idx[tok_row, j] = slots
    # Slot bits as ranges, O(rows + new blocks) not O(tokens): each row's in-place
    # run in its (exclusive) tail block, then its fresh blocks from slot 0. The
    # blocks are distinct (an exclusive tail is one row's; fresh blocks were free).
    grow = np.flatnonzero(granted & (in_place > 0))
    q = np.arange(max(max_blocks, 1))[None, :]
    fr, fq = np.nonzero(granted[:, None] & (q < need[:, None]))
    blocks = np.concatenate([tb[grow], new_ids[fr, fq]])
    starts = np.concatenate([pos[grow], np.zeros(fr.size, np.int64)])
    lengths = np.concatenate([in_place[grow], np.minimum(bs, rest[fr] - fq * bs)])
    h.set_slots(blocks, h.slots[blocks] | range_mask(starts, lengths, c.slot_words))
  g = np.flatnonzero(granted & real & (n_tok > 0))
  if g.size:
    q = np.arange(max_blocks)[None, :]
    rr, qq = np.nonzero(q < need[g][:, None])
    h.extend_rows(row[g], tail[g], in_place[g], rr, ns[g][rr] + qq, new_ids[g][rr, qq],
                  np.minimum(bs, rest[g][rr] - qq * bs), need[g], n_tok[g])
  if np.any(granted & (n_tok > 0)):
    h.step += 1
  return slot_idx.astype(np.int32), _aborted(status, granted | ~real)


def release(h: HostState, ids: np.ndarray, *, atomic: bool) -> np.ndarray:
  """`sequences.release`; returns `status i32[B]`."""
  ids = np.asarray(ids, np.int64)
  if ids.size == 1:
    return _release_one(h, int(ids[0]))
  real = ids != -1
  status = row_status(h, ids, want_active=True)
  ok = (status == _OK) & real
  if atomic:
    ok = ok & bool(np.all(status == _OK))
  if ok.any():
    rows = ids[ok]
    used = h.used_mask(rows)
    blocks = h.block[rows][used]
    h.write_rows(rows, clear=True)
    h.change_refs(blocks, -np.ones(blocks.size, np.int64))
  return _aborted(status, ok | ~real)


def apply_ref_deltas(h: HostState, block_ids: np.ndarray, deltas: np.ndarray,
                     *, apply: bool = True) -> np.ndarray:
  """`alloc.apply_ref_deltas`; returns `status i32[K]` (applied iff all OK and `apply`)."""
  n = h.config.num_blocks
  block_ids = np.asarray(block_ids, np.int64)
  deltas = np.asarray(deltas, np.int64)
  fast = _apply_ref_deltas_fast(h, block_ids, deltas, apply=apply)
  if fast is not None:
    return fast
  if block_ids.size <= SMALL_DELTAS:
    return _apply_ref_deltas_small(h, block_ids, deltas, apply=apply)
  pad = block_ids == -1
  in_range = (block_ids >= 0) & (block_ids < n)
  cb = _clamp(block_ids, 0, n - 1)
  d = np.where(in_range, deltas, 0)
  total = _summed_per_id(np.where(in_range, block_ids, n), d)
  ref = h.ref_count[cb].astype(np.int64)
  overflow = in_range & (total > 0) & (ref > _I32_MAX - np.maximum(total, 0))
  new_ref = np.where(overflow, _I32_MAX, ref + total)
  table_refs = np.where(in_range, h.table_refs[cb], 0)
  underflow = in_range & (new_ref < 0)
  in_use = in_range & (total < 0) & (new_ref < table_refs)
  incref_free = in_range & (deltas > 0) & (ref == 0)
  status = np.where(underflow, _REF_UNDERFLOW,
                    np.where(in_use, _BLOCK_IN_USE, _OK))
  status = np.where(overflow, _REF_OVERFLOW, status)
  status = np.where(~in_range | incref_free, _INVALID_BLOCK, status)
  status = np.where(pad, _OK, status)
  all_ok = bool(np.all(status == _OK))
  status = np.where(all_ok | (status != _OK) | pad, status, _ABORTED)
  if all_ok and apply and in_range.any():
    h.change_refs(block_ids[in_range], deltas[in_range])
  return status.astype(np.int32)


def _apply_ref_deltas_fast(h: HostState, block_ids: np.ndarray, deltas: np.ndarray, *,
                           apply: bool) -> np.ndarray | None:
  """`apply_ref_deltas` when every entry is a distinct in-range block and every change
  is valid (what a prefix cache hands over): a dozen numpy calls. None otherwise (the
  other paths then decide the statuses)."""
  n = h.config.num_blocks
  k = block_ids.size
  if 0 < k <= SMALL_DELTAS and deltas.shape == block_ids.shape:  # a few: plain Python
    ids = block_ids.tolist()
    if min(ids) < 0 or max(ids) >= n or len(set(ids)) != k:
      return None
    old = h.ref_count[block_ids].tolist()
    new = []
    for r, d, t in zip(old, deltas.tolist(), h.table_refs[block_ids].tolist()):
      x = r + d
      if x < 0 or x > _I32_MAX or (d > 0 and r == 0) or (d < 0 and x < t):
        return None
      new.append(x)
    if apply:
      h.set_refs_small(block_ids, ids, old, new)
    return np.zeros(k, np.int32)
  if block_ids.size == 0 or block_ids.min() < 0 or block_ids.max() >= n:
    return None
  if block_ids.size > 1 and not distinct_mask(h.stamp, block_ids).all():
    return None
  ref = h.ref_count[block_ids]
  new = ref + deltas
  if deltas.max() <= 0:  # decrefs (an eviction): new >= table_refs >= 0 is all to check
    bad = new < h.table_refs[block_ids]
  else:
    bad = (new < 0) | (new > _I32_MAX) | ((deltas > 0) & (ref == 0)) | (
        (deltas < 0) & (new < h.table_refs[block_ids]))
  if bad.any():
    return None
  if apply:
    h.set_refs(block_ids, ref, new)
  return np.zeros(block_ids.size, np.int32)


def _apply_ref_deltas_small(h: HostState, block_ids: np.ndarray, deltas: np.ndarray, *,
                            apply: bool) -> np.ndarray:
  """`apply_ref_deltas` of a few entries, in plain Python (same statuses, same order
  of precedence: invalid block, overflow, underflow, in use)."""
  n = h.config.num_blocks
  ids, ds = block_ids.tolist(), deltas.tolist()
  total: dict[int, int] = {}
  for b, d in zip(ids, ds):
    if 0 <= b < n:
      total[b] = total.get(b, 0) + d
  status = []
  for b, d in zip(ids, ds):
    if b == -1:
      status.append(_OK)
      continue
    if not 0 <= b < n:
      status.append(_INVALID_BLOCK)
      continue
    ref, t = int(h.ref_count[b]), total[b]
    if d > 0 and ref == 0:
      status.append(_INVALID_BLOCK)
    elif t > 0 and ref > _I32_MAX - t:
      status.append(_REF_OVERFLOW)
    elif ref + t < 0:
      status.append(_REF_UNDERFLOW)
    elif t < 0 and ref + t < int(h.table_refs[b]):
      status.append(_BLOCK_IN_USE)
    else:
      status.append(_OK)
  if any(status):
    return np.array([_ABORTED if st == _OK and b != -1 else st
                     for st, b in zip(status, ids)], np.int32)
  keep = [j for j, b in enumerate(ids) if b != -1]
  if apply and keep:
    h.change_refs(block_ids[keep], deltas[keep])
  return np.zeros(len(ids), np.int32)


def _summed_per_id(ids: np.ndarray, values: np.ndarray) -> np.ndarray:
  """`i64[K]`: for each entry, the sum of `values` over the entries with its id."""
  uniq, totals = sum_by_id(ids, values)
  return totals[np.searchsorted(uniq, ids)]


def release_with_refs(h: HostState, ids: np.ndarray, block_ids: np.ndarray,
                      deltas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """`sequences.release_with_refs`; returns `(row_status, ref_status)`.

  A few distinct live rows with valid distinct deltas (a step's finishing
  sequences) take one pass (`HostState.release_rows`), with the same end state.
  """
  ids = np.asarray(ids, np.int64)
  block_ids = np.asarray(block_ids, np.int64)
  if ids.size <= SMALL_DELTAS:
    rows = ids.tolist()
    s, active = h.config.max_seqs, h.active
    if (len(set(rows)) == len(rows) and all(0 <= i < s and active[i] for i in rows)):
      deltas = np.asarray(deltas, np.int64)
      if not block_ids.size or _apply_ref_deltas_fast(h, block_ids, deltas,
                                                      apply=False) is not None:
        h.release_rows(ids, block_ids, deltas.reshape(-1) if block_ids.size else block_ids)
        return np.zeros(ids.shape, np.int32), np.zeros(block_ids.shape, np.int32)
  rows = row_status(h, ids, want_active=True)
  rows_ok = bool(np.all(rows == _OK))
  ref_status = apply_ref_deltas(h, np.where(rows_ok, block_ids, -1), deltas, apply=False)
  refs_ok = bool(np.all(ref_status == _OK))
  ref_status = np.where(rows_ok | (block_ids == -1), ref_status, _ABORTED)
  if refs_ok and rows_ok:
    apply_ref_deltas(h, block_ids, deltas)
    row_st = release(h, ids, atomic=True)
  else:
    row_st = np.where((rows == _OK) & (ids != -1), _ABORTED, rows)
  return row_st.astype(np.int32), ref_status.astype(np.int32)


def fork(h: HostState, src_ids: np.ndarray, dst_ids: np.ndarray) -> np.ndarray:
  """`sequences.fork(atomic=True)`; returns `status i32[B]`."""
  s = h.config.max_seqs
  src_ids = np.asarray(src_ids, np.int64)
  dst_ids = np.asarray(dst_ids, np.int64)
  real = dst_ids != -1
  src_ok = (src_ids >= 0) & (src_ids < s) & h.active[_clamp(src_ids, 0, s - 1)]
  status = row_status(h, dst_ids, want_active=False)
  status = np.where(real & ~src_ok, _INVALID_SEQUENCE, status)
  ok = (status == _OK) & real & bool(np.all(status == _OK))
  if ok.any():
    src, dst = src_ids[ok], dst_ids[ok]
    used = h.used_mask(src)
    blocks = h.block[src][used]
    h.write_rows(dst, block=h.block[src], start=h.start[src], length=h.length[src],
                 num_segments=h.num_segments[src], seq_len=h.seq_len[src], active=True)
    h.change_refs(blocks, np.ones(blocks.size, np.int64))
  return _aborted(status, ok | ~real)


def cow_split(h: HostState, ids: np.ndarray, *, atomic: bool) -> tuple[np.ndarray, np.ndarray]:
  """`slots.cow_split`; returns `(split bool[B], status i32[B])`; records the copies."""
  c = h.config
  bs, m, s = c.block_size, c.max_segments, c.max_seqs
  ids = np.asarray(ids, np.int64)
  if ids.size == 1:
    return _cow_split_one(h, int(ids[0]))
  real = ids != -1
  status = row_status(h, ids, want_active=True)
  row = _clamp(ids, 0, s - 1)
  ns = h.num_segments[row].astype(np.int64)
  tail = _clamp(ns - 1, 0, m - 1)
  tb = h.block[row, tail].astype(np.int64)
  ts = h.start[row, tail].astype(np.int64)
  tl = h.length[row, tail].astype(np.int64)
  pos = ts + tl
  i = np.arange(bs)[None, :]
  after_busy = np.any(slot_bits(h.slots[tb], bs) & (i >= pos[:, None]), axis=1)
  blocked = (h.ref_count[tb] > 1) | (h.region[tb] != REGION_DYNAMIC) | (ts > 0) | after_busy
  wants = (status == _OK) & real & (ns > 0) & (tl < bs) & blocked
  valid = (status == _OK) & real
  if atomic:
    valid = valid & bool(np.all(status == _OK))
  need = np.where(wants & valid, 1, 0)
  granted = grant_prefix(need, valid, h.free.num_free, atomic=atomic)
  status = np.where(valid & ~granted, _NO_FREE_BLOCK, status)
  split = granted & (need > 0)
  if split.any():
    fresh = _take_lowest(h, need, granted, 1)[:, 0]
    g = np.flatnonzero(split)
    h.copy_slots(tb[g], ts[g], fresh[g], np.zeros(g.size, np.int64), tl[g])
    h.set_slots(fresh[g], range_mask(np.zeros(g.size, np.int64), tl[g], c.slot_words))
    rows = row[g]
    blk, st = h.block[rows].copy(), h.start[rows].copy()
    blk[np.arange(g.size), tail[g]] = fresh[g]
    st[np.arange(g.size), tail[g]] = 0
    h.write_rows(rows, block=blk, start=st)
    h.change_refs(tb[g], -np.ones(g.size, np.int64))
  return split, _aborted(status, granted | ~real)


def move_blocks(h: HostState, src: np.ndarray, dst: np.ndarray, *,
                dst_region: int) -> tuple[np.ndarray, np.ndarray]:
  """`compact.move_blocks` (compaction: region 0; promotion: region 1).

  Returns `(src, dst, status i32[M])`: the moves applied (none when refused) and
  the status per entry; `remap_of` builds the `remap` holders outside the pool follow.
  """
  n = h.config.num_blocks
  src = np.asarray(src, np.int64)
  dst = np.asarray(dst, np.int64)
  pad = (src == -1) & (dst == -1)
  in_range = (src >= 0) & (src < n) & (dst >= 0) & (dst < n)
  cs, cd = _clamp(src, 0, n - 1), _clamp(dst, 0, n - 1)
  src_ok = (h.ref_count[cs] > 0) & (h.region[cs] == REGION_DYNAMIC)
  dst_ok = (h.ref_count[cd] == 0) & (h.region[cd] == dst_region)
  k = np.arange(src.shape[0])
  unique = first_occurrence(np.where(pad, -1 - k, src)) & first_occurrence(
      np.where(pad, -1 - k, dst))
  good = pad | (in_range & src_ok & dst_ok & unique)
  status = np.where(good, _OK, _INVALID_BLOCK)
  all_ok = bool(np.all(good))
  status = np.where((not all_ok) & good & ~pad, _ABORTED, status).astype(np.int32)
  move = all_ok & ~pad
  s, d = src[move], dst[move]
  if s.size:
    ref, words = h.ref_count[s].copy(), h.slots[s].copy()
    h.log.touch_blocks(h, np.concatenate([s, d]))
    h.ref_count[d] = ref
    h.slots[d] = words
    h.ref_count[s] = 0
    h.slots[s] = 0
    h.free.mark(s, +1)  # sources are dynamic: free now
    if dst_region == REGION_DYNAMIC:
      h.free.mark(d, -1)
    else:
      h.num_free_base -= int(d.size)
    h.log.freed(s)
    h.move_pages(s, d)
    # Tables: every used entry on a moved block follows it.
    order = np.argsort(s)
    s_sorted, d_sorted = s[order], d[order]
    hit = h.used_mask() & np.isin(h.block, s_sorted)
    rows = np.flatnonzero(hit.any(axis=1))
    if rows.size:
      blk = h.block[rows].copy()
      sub = hit[rows]
      blk[sub] = d_sorted[np.searchsorted(s_sorted, blk[sub])]
      h.write_rows(rows, block=blk)
  return s, d, status


def remap_of(n: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
  """`i32[n]`: `remap[old] = new` for moved blocks, identity elsewhere."""
  remap = np.arange(n, dtype=np.int32)
  remap[np.asarray(src, np.int64)] = np.asarray(dst, np.int32)
  return remap


# ---------------------------------------------------------------------------
# Host planners (numpy twins of the device planners; they read the mirror).
# ---------------------------------------------------------------------------


def plan_compaction(h: HostState, *, budget: int) -> tuple[np.ndarray, np.ndarray]:
  """`compact.plan_compaction`: the highest live dynamic blocks into the lowest free."""
  dyn = h.region == REGION_DYNAMIC
  live = np.flatnonzero((h.ref_count > 0) & dyn)[::-1][:budget]
  free = np.flatnonzero((h.ref_count == 0) & dyn)[:budget]
  k = min(live.size, free.size)
  ok = live[:k] > free[:k]
  k = int(np.argmin(ok)) if not ok.all() else k
  src = np.full(budget, -1, np.int32)
  dst = np.full(budget, -1, np.int32)
  src[:k], dst[:k] = live[:k], free[:k]
  return src, dst


def plan_shrink(h: HostState, num_blocks: int, *, budget: int) -> tuple[np.ndarray, np.ndarray]:
  """`regions.plan_shrink`: the highest live blocks at or above the cut into the lowest
  free blocks below it."""
  dyn = h.region == REGION_DYNAMIC
  ref = h.ref_count
  above = (np.flatnonzero((ref[num_blocks:] > 0) & dyn[num_blocks:]) + num_blocks)[::-1][:budget]
  below = np.flatnonzero((ref[:num_blocks] == 0) & dyn[:num_blocks])[:budget]
  k = min(above.size, below.size)
  src = np.full(budget, -1, np.int32)
  dst = np.full(budget, -1, np.int32)
  src[:k], dst[:k] = above[:k], below[:k]
  return src, dst


def shrink_progress(h: HostState, num_blocks: int) -> tuple[int, int]:
  """`regions.shrink_progress`: `(held_above, free_below)` of a cut."""
  dyn = h.region == REGION_DYNAMIC
  ref = h.ref_count
  held = int(np.count_nonzero((ref[num_blocks:] > 0) & dyn[num_blocks:]))
  free_below = int(np.count_nonzero((ref[:num_blocks] == 0) & dyn[:num_blocks]))
  return held, free_below


def plan_promotion(h: HostState, min_readers: int, *, max_moves: int
                   ) -> tuple[np.ndarray, np.ndarray]:
  """`regions.plan_promotion`: most-read dynamic blocks into the lowest free base blocks."""
  ref = h.ref_count.astype(np.int64)
  cand = np.flatnonzero((h.region == REGION_DYNAMIC) & (ref >= max(int(min_readers), 1)))
  order = cand[np.lexsort((cand, -ref[cand]))]
  base = np.flatnonzero((h.region == REGION_BASE) & (ref == 0))
  k = min(order.size, base.size, max_moves)
  src = np.full(max_moves, -1, np.int32)
  dst = np.full(max_moves, -1, np.int32)
  src[:k], dst[:k] = order[:k], base[:k]
  return src, dst


def allocate(h: HostState, num: int, *, contiguous: str) -> tuple[np.ndarray, int]:
  """`alloc.allocate` with `fit="first"` (what `BlockPool.allocate` runs); returns
  `(ids i64[num], status)`."""
  num = int(num)
  if num > h.free.num_free:
    return np.zeros(0, np.int64), int(_NO_FREE_BLOCK)
  ids = h.free.lowest(num)
  if contiguous != "never" and num > 1 and ids[-1] - ids[0] != num - 1:
    starts, ends = compact.free_runs(h.free.mask())
    fits = np.flatnonzero(ends - starts >= num)
    if fits.size:  # the lowest run long enough
      ids = np.arange(starts[fits[0]], starts[fits[0]] + num, dtype=np.int64)
    elif contiguous == "require":
      return np.zeros(0, np.int64), int(Status.NO_CONTIGUOUS_RUN)
  h.take_blocks(ids)
  return ids, int(_OK)


# ---------------------------------------------------------------- one row, lean
# A request at a time (the `CachedPool` path) calls with one row: these give the
# general functions' results with Python scalars instead of `[B, ...]` arrays
# (each numpy call costs microseconds whatever its size). The general functions
# route a one-row call here; the differential tests compare both with the device.


_NO_BLOCKS = np.zeros(0, np.int64)


def _int_to_words(x: int, num_words: int) -> np.ndarray:
  return np.array([(x >> (32 * k)) & 0xFFFFFFFF for k in range(num_words)], np.uint32)


def _mask_int(start: int, length: int) -> int:
  return ((1 << length) - 1) << start if length > 0 else 0


_PREFIX_WORDS: dict[tuple[int, int], np.ndarray] = {}


def _prefix_words(length: int, num_words: int) -> np.ndarray:
  """`u32[1, num_words]`: slots `[0, length)` set (cached, read only)."""
  a = _PREFIX_WORDS.get((length, num_words))
  if a is None:
    a = _PREFIX_WORDS[length, num_words] = _int_to_words(_mask_int(0, length), num_words)[None]
    a.setflags(write=False)
  return a


def _row_ok(h: HostState, i: int, *, want_active: bool) -> bool:
  return 0 <= i < h.config.max_seqs and bool(h.active[i]) == want_active


def open_checked(h: HostState, i: int, seg_block: np.ndarray, seg_start: np.ndarray,
                 seg_length: np.ndarray) -> np.ndarray:
  """`open_rows` of one row whose segments passed `open_segments_status` (not
  checked again); returns `status i32[1]`."""
  return _open_one(h, i, seg_block, seg_start, seg_length, int(seg_block.shape[0]),
                   checked=True)


def _open_one(h: HostState, i: int, seg_block: np.ndarray, seg_start: np.ndarray,
              seg_length: np.ndarray, k: int, *, checked: bool = False) -> np.ndarray:
  """`open_rows` of one row (`k` segments, in `seg_*[:k]`)."""
  c = h.config
  n, bs, m = c.num_blocks, c.block_size, c.max_segments
  if i == -1:
    return np.array([_OK], np.int32)
  if not _row_ok(h, i, want_active=False):
    return np.array([_INVALID_SEQUENCE], np.int32)
  if k < 0 or k > min(seg_block.shape[0], m):
    return np.array([_INVALID_COUNT], np.int32)
  blk = seg_block[:k].astype(np.int64)
  st = seg_start[:k].astype(np.int64)
  ln = seg_length[:k].astype(np.int64)
  if k and not checked:
    status = _check_open_segments(h, blk, st, ln)
    if status != _OK:
      return np.array([status], np.int32)
  h.open_row(i, blk, st, ln)
  return np.array([_OK], np.int32)


def open_one_copying_tail(h: HostState, i: int, seg_block: np.ndarray, seg_start: np.ndarray,
                          seg_length: np.ndarray, *,
                          checked: bool = False) -> tuple[np.ndarray, bool]:
  """`open_rows` of one row then `cow_split(atomic=False)` of it, in one pass (the
  row opens on the copy); returns `(status i32[1], copied)` as the two calls give.
  `checked`: the segments passed `open_segments_status` already."""
  k = int(seg_block.shape[0])
  c = h.config
  bs = c.block_size
  if k == 0 or not _row_ok(h, i, want_active=False):
    return _open_one(h, i, seg_block, seg_start, seg_length, k), False
  tb, ts, tl = int(seg_block[-1]), int(seg_start[-1]), int(seg_length[-1])
  if not 0 <= tb < c.num_blocks or int(h.ref_count[tb]) < 1 or tl >= bs or ts < 0 or (
      h.free.num_free < 1):
    # No copy to make (or the open fails): the open alone, then the split's own decision.
    status = _open_one(h, i, seg_block, seg_start, seg_length, k)
    if status[0] != _OK:
      return status, False
    split, _ = _cow_split_one(h, i)
    return status, bool(split[0])
  blk = seg_block.astype(np.int64)
  st = seg_start.astype(np.int64)
  ln = seg_length.astype(np.int64)
  status = _OK if checked else _check_open_segments(h, blk, st, ln)
  if status != _OK:
    return np.array([status], np.int32), False
  # After the open the tail block has >= 2 references (this row's and the holder's the
  # check found): `cow_split` copies it into the lowest free block.
  fresh = h.free.lowest(1)
  f = int(fresh[0])
  h.take_blocks(fresh, _prefix_words(tl, c.slot_words))
  h.log.copies(h, np.array([[tb, ts, f, 0, tl]], np.int64))
  h.log.touch_blocks(h, np.array([tb], np.int64))  # as the split's decref does
  blk[-1], st[-1] = f, 0
  h.open_row(i, blk, st, ln, tail_taken=True)
  return np.array([_OK], np.int32), True


def open_segments_status(h: HostState, blk: np.ndarray, st: np.ndarray, ln: np.ndarray) -> int:
  """The status an open on these segments gets from its segment checks (`_open_one`'s,
  without the row's): live blocks, well-formed segments on written slots."""
  return _check_open_segments(h, np.asarray(blk, np.int64), np.asarray(st, np.int64),
                              np.asarray(ln, np.int64))


def _check_open_segments(h: HostState, blk: np.ndarray, st: np.ndarray, ln: np.ndarray) -> int:
  """The segment checks of `_open_one` (int64 arrays, at least one segment)."""
  c = h.config
  if blk.size <= SMALL_DELTAS:  # a few: plain Python
    n, bs = c.num_blocks, c.block_size
    b, s, l = blk.tolist(), st.tolist(), ln.tolist()
    if min(b) < 0 or max(b) >= n or min(h.ref_count[blk].tolist()) <= 0:
      return _INVALID_BLOCK
    if min(s) < 0 or max(s) >= bs or min(l) < 1 or any(x > bs - y for x, y in zip(l, s)):
      return _INVALID_SEGMENT
    words = h.slots[blk]
    held = (words[:, 0].tolist() if c.slot_words == 1 else [words_to_int(w) for w in words])
    for w, y, x in zip(held, s, l):
      mask = ((1 << x) - 1) << y
      if w & mask != mask:
        return _INVALID_SEGMENT
    return _OK
  if blk.min() < 0 or blk.max() >= c.num_blocks or (h.ref_count[blk] <= 0).any():
    return _INVALID_BLOCK
  if st.min() < 0 or (st >= c.block_size).any() or ln.min() < 1 or (
      ln > c.block_size - st).any():
    return _INVALID_SEGMENT
  mask = range_mask(st, ln, c.slot_words)
  if ((h.slots[blk] & mask) != mask).any():
    return _INVALID_SEGMENT
  return _OK


def _reserve_one(h: HostState, i: int, count: int,
                 max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
  """`reserve` of one row (atomic or not: the same for one row)."""
  c = h.config
  bs, m = c.block_size, c.max_segments
  slot_idx = np.full((1, max_new_tokens), -1, np.int32)
  if i == -1:
    return slot_idx, np.array([_OK], np.int32)
  if not _row_ok(h, i, want_active=True):
    return slot_idx, np.array([_INVALID_SEQUENCE], np.int32)
  if count < 0 or count > max_new_tokens:
    return slot_idx, np.array([_INVALID_COUNT], np.int32)
  ns = int(h.num_segments[i])
  tail = min(max(ns - 1, 0), m - 1)
  tb, pos = h.tail_block.item(i), h.tail_end.item(i)
  room = h.tail_limit.item(i) - pos if h.ref_count.item(tb) == 1 else 0
  in_place = min(count, room)
  rest = count - in_place
  need = _cdiv(rest, bs)
  if ns + need > m:
    return slot_idx, np.array([_TABLE_FULL], np.int32)
  if need > h.free.num_free:
    return slot_idx, np.array([_NO_FREE_BLOCK], np.int32)
  if count == 0:
    return slot_idx, np.array([_OK], np.int32)
  w = c.slot_words
  out = slot_idx[0]
  if in_place:
    out[:in_place] = np.arange(tb * bs + pos, tb * bs + pos + in_place)
    h.set_slots(np.array([tb], np.int64),
                _int_to_words(words_to_int(h.slots[tb]) | _mask_int(pos, in_place), w)[None, :])
  fresh, lengths = _NO_BLOCKS, _NO_BLOCKS
  if need:
    fresh, lengths = _take_fresh(h, need, rest)
    out[in_place:count] = (fresh[:, None] * bs + arange(bs)).reshape(-1)[:rest]
  h.extend_row(i, tail, in_place, fresh, lengths, count)
  h.step += 1
  return slot_idx, np.array([_OK], np.int32)


def _reserve_rows(h: HostState, ids: list[int], counts: list[int],
                  max_new_tokens: int) -> tuple[np.ndarray, list[int]]:
  """`reserve(atomic=False)` of a few rows, one at a time in plain Python; returns
  `(slot_idx i32[k, T], status)`. The clock is the caller's to move.

  The general path grants blocks first come first served (a valid row gets them
  iff the needs of the valid rows up to it fit). Row by row gives the same: the
  rows are distinct, each reads only its own entries and tail block, and the
  lowest free blocks left after the rows before it are the ones it would get.
  """
  c = h.config
  bs, m, s = c.block_size, c.max_segments, c.max_seqs
  slot_idx = np.full((len(ids), max_new_tokens), -1, np.int32)
  status = [_OK] * len(ids)
  seen: set[int] = set()
  num_free = h.free.num_free
  wanted = 0  # blocks the valid rows so far ask for
  active, ref_count = h.active, h.ref_count
  tail_block, tail_end, tail_limit = h.tail_block, h.tail_end, h.tail_limit
  for j, (i, count) in enumerate(zip(ids, counts)):
    if i == -1:
      continue
    first = i not in seen
    seen.add(i)
    if not (first and 0 <= i < s and active[i]):
      status[j] = _INVALID_SEQUENCE
      continue
    if count < 0 or count > max_new_tokens:
      status[j] = _INVALID_COUNT
      continue
    ns = int(h.num_segments[i])
    tail = max(ns - 1, 0)
    tb, pos = tail_block.item(i), tail_end.item(i)
    room = tail_limit.item(i) - pos if ref_count.item(tb) == 1 else 0
    in_place = min(count, room)
    rest = count - in_place
    need = -(-rest // bs)
    if ns + need > m:
      status[j] = _TABLE_FULL
      continue
    wanted += need
    if need and wanted > num_free:
      status[j] = _NO_FREE_BLOCK
      continue
    if count == 0:
      continue
    out = slot_idx[j]
    if in_place:
      out[:in_place] = arange(in_place) + (tb * bs + pos)
      h.set_slots(np.array([tb], np.int64),
                  _int_to_words(words_to_int(h.slots[tb]) | _mask_int(pos, in_place),
                                c.slot_words)[None, :])
    fresh, lengths = _NO_BLOCKS, _NO_BLOCKS
    if need:
      fresh, lengths = _take_fresh(h, need, rest)
      out[in_place:count] = (fresh[:, None] * bs + arange(bs)).reshape(-1)[:rest]
    h.extend_row(i, tail, in_place, fresh, lengths, count)
  return slot_idx, status


def _take_fresh(h: HostState, need: int, rest: int) -> tuple[np.ndarray, np.ndarray]:
  """Takes the `need` lowest free blocks for `rest` tokens from slot 0 on (full
  blocks, then the last one's rest), their slots set; returns `(blocks, lengths)`."""
  bs, w = h.config.block_size, h.config.slot_words
  fresh = h.free.lowest(need)
  last = rest - (need - 1) * bs
  lengths = np.full(need, bs, np.int64)
  lengths[-1] = last
  if need == 1:
    words = _prefix_words(last, w)
  else:
    words = np.empty((need, w), np.uint32)
    words[:] = _prefix_words(bs, w)
    words[-1] = _prefix_words(last, w)
  h.take_blocks(fresh, words)
  return fresh, lengths


def _release_one(h: HostState, i: int) -> np.ndarray:
  """`release` of one row."""
  if i == -1:
    return np.array([_OK], np.int32)
  if not _row_ok(h, i, want_active=True):
    return np.array([_INVALID_SEQUENCE], np.int32)
  h.release_row(i)
  return np.array([_OK], np.int32)


def _cow_split_one(h: HostState, i: int) -> tuple[np.ndarray, np.ndarray]:
  """`cow_split` of one row."""
  c = h.config
  bs, m = c.block_size, c.max_segments
  no = np.zeros(1, bool)
  if i == -1:
    return no, np.array([_OK], np.int32)
  if not _row_ok(h, i, want_active=True):
    return no, np.array([_INVALID_SEQUENCE], np.int32)
  ns = int(h.num_segments[i])
  tail = min(max(ns - 1, 0), m - 1)
  tb = int(h.block[i, tail])
  ts, tl = int(h.start[i, tail]), int(h.length[i, tail])
  after_busy = (words_to_int(h.slots[tb]) >> (ts + tl)) != 0
  blocked = (int(h.ref_count[tb]) > 1 or int(h.region[tb]) != REGION_DYNAMIC or ts > 0
             or after_busy)
  if not (ns > 0 and tl < bs and blocked):
    return no, np.array([_OK], np.int32)
  if h.free.num_free < 1:
    return no, np.array([_NO_FREE_BLOCK], np.int32)
  fresh = h.free.lowest(1)
  h.take_blocks(fresh, _prefix_words(tl, c.slot_words))
  f = int(fresh[0])
  h.log.copies(h, np.array([[tb, ts, f, 0, tl]], np.int64))
  h.move_tail(i, tail, f)
  h._change_ref(tb, -1)  # pylint: disable=protected-access
  return np.ones(1, bool), np.array([_OK], np.int32)

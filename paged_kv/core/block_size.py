"""Choosing a pool's block size for a workload's length distribution (host, numpy only).

A block of `B` tokens is the unit of allocation and of the decode kernel's reads.
Two effects pull in opposite directions:

* **Internal waste.** A sequence of `L` tokens holds `ceil(L / B)` blocks; its last
  (tail) block leaves `B - (L mod B)` slots unused, up to `B - 1`. Short sequences
  lose most: a 20-token node wastes 12 of 32 slots at `B = 16`, 44 of 64 at `B = 64`.
  Slotted packing (`slots.pack_slots`) copies the tail of a finished sequence (one
  a holder keeps, e.g. the prefix cache) into free slots of a shared block, winning
  back part of its empty slots (`slot_recovery`: all of them with ideal packing);
  the tail of a *live* row may still grow in place and is never packed.
* **Read bandwidth.** Decode reads whole pages; bigger pages mean fewer, longer
  contiguous reads and fewer table entries per token, so they may read faster. How
  much is a device property, measured by the `gpu_check` rows at blocks 16, 32 and
  64 (`bandwidth_from_gpu_check`); until a table is given, every candidate counts
  as equally fast and the rule reports `measured=False`.

The rule. Decode is bandwidth bound and a full pool is read once per step, so with
the pool's bytes fixed the decode throughput is proportional to
`efficiency(B) * bandwidth(B)`: efficiency sets how many sequences fit, bandwidth
how fast their pages are read. `choose_block_size` picks the candidate with the
largest product (ties: the smallest block). With no bandwidth table it picks the
smallest candidate, since a bigger block never holds the same lengths with less
waste. `BlockSizeChoice.break_even` says, per candidate, how much faster than the
smallest block it must read to score as high: `efficiency(smallest) / efficiency(B)`.

The model counts tail slots only: a sequence's full blocks hold no waste at any
block size, and prefixes shared at 512-token granularity (the Mooncake trace's) stay
whole blocks at every candidate. Weights read per step, and the metadata per block
(a few bytes against a block's K/V), are left out. `benchmarks/block_size_study.py`
checks the model against the pool's own transitions over the public traces.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Mapping

import numpy as np

from paged_kv.core.errors import InvalidArgument

__all__ = ["BlockSizeChoice", "DEFAULT_CANDIDATES", "bandwidth_from_gpu_check",
           "block_efficiency", "choose_block_size", "length_distribution"]

DEFAULT_CANDIDATES = (16, 32, 64)
"""Block sizes the rule chooses among: those the decode kernels are timed at."""

MAX_BLOCK_SIZE = 128
"""Largest block a `PoolConfig` accepts."""


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def length_distribution(lengths: Iterable[int] | None = None, *,
                        histogram: Mapping[int, int] | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
  """`(lengths, counts)`, both `i64[n]`, from raw lengths or a `{length: count}` histogram.

  Exactly one of `lengths` (one entry per sequence, e.g. a trace's prompt + output
  tokens) and `histogram` must be given. Lengths are positive ints, counts
  non-negative ints, and at least one sequence must be counted.

  Raises:
    InvalidArgument: both or neither given, a non-int, non-positive length or
      negative count, or an empty distribution.
  """
  if (lengths is None) == (histogram is None):
    raise InvalidArgument("give exactly one of lengths and histogram")
  if histogram is not None:
    if not isinstance(histogram, Mapping):
      raise InvalidArgument(f"histogram must be a mapping length -> count, got "
                            f"{type(histogram).__name__}")
    items = list(histogram.items())
    for length, count in items:
      if not _is_int(length) or length <= 0:
        raise InvalidArgument(f"histogram length must be a positive int, got {length!r}")
      if not _is_int(count) or count < 0:
        raise InvalidArgument(f"histogram count must be a non-negative int, got {count!r} "
                              f"(length {length})")
    values = np.array([int(k) for k, _ in items], np.int64)
    counts = np.array([int(c) for _, c in items], np.int64)
  else:
    if isinstance(lengths, (str, bytes, Mapping)):
      raise InvalidArgument(f"lengths must be a sequence of ints, got {type(lengths).__name__}")
    raw = np.asarray(list(lengths) if not isinstance(lengths, np.ndarray) else lengths)
    if raw.ndim != 1:
      raise InvalidArgument(f"lengths must be one-dimensional, got shape {raw.shape}")
    if raw.size and not np.issubdtype(raw.dtype, np.integer):
      raise InvalidArgument(f"lengths must be ints, got dtype {raw.dtype}")
    if raw.size and int(raw.min()) <= 0:
      raise InvalidArgument(f"lengths must be positive, got {int(raw.min())}")
    values, counts = np.unique(raw.astype(np.int64), return_counts=True)
    counts = counts.astype(np.int64)
  if int(counts.sum()) == 0:
    raise InvalidArgument("the length distribution counts no sequence")
  return values, counts


def _check_block_size(b) -> int:
  if not _is_int(b) or b < 1 or b > MAX_BLOCK_SIZE or b & (b - 1):
    raise InvalidArgument(f"block size must be a power of two in [1, {MAX_BLOCK_SIZE}], "
                          f"got {b!r}")
  return int(b)


def _check_share(value, name: str = "slotted_share") -> float:
  if (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real)
      or not 0.0 <= float(value) <= 1.0):
    raise InvalidArgument(f"{name} must be a number in [0, 1], got {value!r}")
  return float(value)


def block_efficiency(lengths: np.ndarray, counts: np.ndarray, block_size: int, *,
                     slotted_share: float = 0.0, slot_recovery: float = 1.0) -> float:
  """Tokens held / slots allocated for the distribution at `block_size`, in (0, 1].

  Every sequence costs `ceil(L / B) * B` slots, except that for a share
  `slotted_share` of them (finished ones a holder keeps, whose tails slotted packing
  moves into shared blocks) a share `slot_recovery` of the tail's empty slots is won
  back: 1 is ideal packing (a slotted tail costs its own tokens); what
  `slots.pack_slots` achieves depends on the order tails reach it and is measured by
  `benchmarks/block_size_study.py`.

  Raises:
    InvalidArgument: a bad block size, share or recovery (the distribution is taken
      as built by `length_distribution`).
  """
  b = _check_block_size(block_size)
  won = _check_share(slotted_share) * _check_share(slot_recovery, "slot_recovery")
  tokens = float(np.sum(lengths * counts))
  flat = float(np.sum(-(-lengths // b) * b * counts))
  return tokens / (flat - won * (flat - tokens))


def bandwidth_from_gpu_check(record: Mapping, shape: str = "b64x8k") -> dict[int, float]:
  """`{block size: GB/s}` of the default decode path from a `gpu_check` JSON record.

  Reads the rows `layer/<shape>/default` (block 16, the main table) and
  `layer/<shape>-bs<B>/default` (the block-size rows), each only if it passed and
  carries a rate. `shape` is `b64x8k` (batch 64 at 8k) or `b1x128k` (one row at 128k):
  pick the one closer to the workload. Accepts the script's `gpu_check.json` or a
  `docs/records/gpu_check` record (which wraps it under `"results"`).

  Raises:
    InvalidArgument: no row of that shape has a rate (e.g. a record from before the
      block-size rows, or a dry run that failed them).
  """
  data = record.get("results", record) if isinstance(record, Mapping) else None
  rows = data.get("rows") if isinstance(data, Mapping) else None
  if not isinstance(rows, list):
    raise InvalidArgument("not a gpu_check record: no list of rows")
  out = {}
  for row in rows:
    rid, gbps = row.get("id", ""), row.get("gbps")
    if gbps is None or row.get("status", "ok") != "ok":
      continue
    if rid == f"layer/{shape}/default":
      out[16] = float(gbps)
    elif rid.startswith(f"layer/{shape}-bs") and rid.endswith("/default"):
      size = rid[len(f"layer/{shape}-bs"):-len("/default")]
      if size.isdigit():
        out[int(size)] = float(gbps)
  if not out:
    raise InvalidArgument(f"the gpu_check record has no timed default decode row of shape "
                          f"{shape!r} (layer/{shape}/default, layer/{shape}-bs<B>/default)")
  return out


@dataclasses.dataclass(frozen=True)
class BlockSizeChoice:
  """The rule's pick and the numbers behind it.

  Attributes:
    block_size: the pick.
    candidates: the block sizes weighed, ascending.
    efficiency: `{B: tokens / slots}` at each candidate.
    bandwidth: `{B: relative read rate}` (1.0 for all when unmeasured).
    score: `{B: efficiency * bandwidth}`: decode throughput of a full pool, relative.
    break_even: `{B: efficiency(smallest) / efficiency(B)}`: the read rate, relative to
      the smallest candidate's, at which `B` scores the same.
    measured: whether a bandwidth table was given.
    slotted_share: the share of sequences whose tails were counted as slotted.
    slot_recovery: the share of a slotted tail's empty slots counted as won back.
  """
  block_size: int
  candidates: tuple[int, ...]
  efficiency: dict[int, float]
  bandwidth: dict[int, float]
  score: dict[int, float]
  break_even: dict[int, float]
  measured: bool
  slotted_share: float
  slot_recovery: float


def choose_block_size(lengths: Iterable[int] | None = None, *,
                      histogram: Mapping[int, int] | None = None,
                      bandwidth: Mapping[int, float] | None = None,
                      candidates: Iterable[int] = DEFAULT_CANDIDATES,
                      slotted_share: float = 0.0,
                      slot_recovery: float = 1.0) -> BlockSizeChoice:
  """Picks the block size that maximises `efficiency * bandwidth` (module docstring).

  Args:
    lengths: one length per resident sequence (tokens), or
    histogram: `{length: count}` instead.
    bandwidth: `{block size: read rate}` in any unit (only ratios matter), e.g.
      `bandwidth_from_gpu_check(record)`; it must cover every candidate. None: all
      equal (unmeasured), which picks the smallest candidate.
    candidates: block sizes to weigh (powers of two up to 128, no repeats).
    slotted_share: share of the sequences whose tails slotted packing holds (the
      finished sequences a prefix cache keeps); 0 counts every tail as a live one.
    slot_recovery: share of a slotted tail's empty slots packing wins back
      (`block_efficiency`; 1: ideal).

  Raises:
    InvalidArgument: a bad distribution (`length_distribution`), candidate, share, or
      recovery, or a bandwidth table missing a candidate or holding a non-positive rate.
  """
  values, counts = length_distribution(lengths, histogram=histogram)
  if isinstance(candidates, (str, bytes)):
    raise InvalidArgument(f"candidates must be block sizes, got {candidates!r}")
  cands = [_check_block_size(b) for b in candidates]
  if not cands or len(set(cands)) != len(cands):
    raise InvalidArgument(f"candidates must be distinct and non-empty, got {cands}")
  cands.sort()
  share = _check_share(slotted_share)
  recovery = _check_share(slot_recovery, "slot_recovery")
  if bandwidth is None:
    rates = {b: 1.0 for b in cands}
  else:
    if not isinstance(bandwidth, Mapping):
      raise InvalidArgument(f"bandwidth must map block size -> rate, got "
                            f"{type(bandwidth).__name__}")
    missing = [b for b in cands if b not in bandwidth]
    if missing:
      raise InvalidArgument(f"bandwidth has no rate for block sizes {missing} "
                            f"(it has {sorted(bandwidth)})")
    rates = {}
    for b in cands:
      r = bandwidth[b]
      if (isinstance(r, (bool, np.bool_)) or not isinstance(r, numbers.Real)
          or not math.isfinite(float(r)) or float(r) <= 0):
        raise InvalidArgument(f"bandwidth[{b}] must be a positive finite number, got {r!r}")
      rates[b] = float(r) / float(bandwidth[cands[0]])
  eff = {b: block_efficiency(values, counts, b, slotted_share=share, slot_recovery=recovery)
         for b in cands}
  score = {b: eff[b] * rates[b] for b in cands}
  best = max(score.values())
  pick = min(b for b in cands if score[b] >= best)
  return BlockSizeChoice(
      block_size=pick, candidates=tuple(cands), efficiency=eff, bandwidth=rates, score=score,
      break_even={b: eff[cands[0]] / eff[b] for b in cands}, measured=bandwidth is not None,
      slotted_share=share, slot_recovery=recovery)

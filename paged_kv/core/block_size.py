"""Choosing a pool's block size for a workload's length distribution (host, numpy only).

A tail block wastes up to `B - 1` slots, while bigger pages may read faster
(measured by the `gpu_check` rows at blocks 16, 32, 64). With the pool's bytes
fixed, decode throughput goes as `efficiency(B) * bandwidth(B)`;
`choose_block_size` picks the largest product (ties and unmeasured bandwidth:
the smallest block). `benchmarks/block_size_study.py` checks the model.
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

  Each sequence costs `ceil(L / B) * B` slots, less `slot_recovery` of its tail's
  empty slots for the share `slotted_share` whose tails slotted packing holds.
  """
  b = _check_block_size(block_size)
  won = _check_share(slotted_share) * _check_share(slot_recovery, "slot_recovery")
  tokens = float(np.sum(lengths * counts))
  flat = float(np.sum(-(-lengths // b) * b * counts))
  return tokens / (flat - won * (flat - tokens))


def bandwidth_from_gpu_check(record: Mapping, shape: str = "b64x8k") -> dict[int, float]:
  """`{block size: GB/s}` of the default decode path from a `gpu_check` record (raw or wrapped).

  Reads the passing `layer/<shape>/default` and `layer/<shape>-bs<B>/default`
  rows (`shape`: `b64x8k` or `b1x128k`); raises `InvalidArgument` when none has a rate.
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
  """The rule's pick and the numbers behind it (dicts keyed by candidate block size).

  `score = efficiency * bandwidth` (bandwidth 1.0 for all when not `measured`);
  `break_even[B] = efficiency(smallest) / efficiency(B)`: the relative read rate
  at which `B` scores as the smallest candidate does.
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

  `lengths` (one per resident sequence) or `histogram` (`{length: count}`) give
  the distribution; `bandwidth` (`{block size: rate}`, any unit, every candidate)
  None counts all as equal; `slotted_share` / `slot_recovery` as in
  `block_efficiency`. Raises `InvalidArgument` for a bad distribution, candidate,
  share, recovery or bandwidth table.
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

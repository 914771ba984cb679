"""Public request traces: file formats, loading, token ids and the exact hit bound.

Host side, numpy only. Two formats are read:

* **Mooncake JSONL** (``*.jsonl``; Kimi's FAST'25 traces): one JSON object per line,
  ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``.
  Each hash id names one 512-token block of the prompt *and every block before it*
  (equal ids mean an identical prefix up to and including that block);
  ``len(hash_ids) == ceil(input_length / 512)``.
* **Azure CSV** (``*.csv``; Splitwise ISCA'24): a header
  ``TIMESTAMP,ContextTokens,GeneratedTokens`` and one row per request with an
  absolute time (``2023-11-16 18:15:46.6805900``). No prefix information.

Token ids: block hash ``h`` expands to the ids ``h * 512 + j``, so a token-level
prefix match equals a hash-level one; content without prefix information gets fresh
ids that match nothing.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Iterable

import numpy as np

__all__ = [
    "KNOWN_TRACES",
    "MOONCAKE_BLOCK_TOKENS",
    "TokenSource",
    "TraceRequest",
    "check_trace_files",
    "describe_trace",
    "exact_hit_bound",
    "load_azure",
    "load_mooncake",
    "load_trace",
    "mooncake_tokens",
    "scaled_prompt",
]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per Mooncake hash id."""

KNOWN_TRACES = {
    "conversation_trace.jsonl": (
        "the Mooncake conversation trace, github.com/kvcache-ai/Mooncake "
        "FAST25-release/traces/conversation_trace.jsonl (Apache-2.0)"
    ),
    "AzureLLMInferenceTrace_conv.csv": (
        "the Azure LLM inference trace (conversation), github.com/Azure/AzurePublicDataset "
        "data/AzureLLMInferenceTrace_conv.csv (CC-BY 4.0)"
    ),
    "AzureLLMInferenceTrace_code.csv": (
        "the Azure LLM inference trace (code), github.com/Azure/AzurePublicDataset "
        "data/AzureLLMInferenceTrace_code.csv (CC-BY 4.0)"
    ),
}
"""Where the public traces the examples default to come from, by file name."""


@dataclasses.dataclass(frozen=True)
class TraceRequest:
  """One trace row.

  Attributes:
    arrival_s: seconds from the start of the trace.
    hash_ids: i64[ceil(input_length / 512)] Mooncake block hashes, or None when the
      trace has no prefix information.
  """

  arrival_s: float
  input_length: int
  output_length: int
  hash_ids: np.ndarray | None = None


def describe_trace(path: str) -> str:
  """A one-line origin of a trace file: the public source for a known name."""
  name = os.path.basename(path)
  return KNOWN_TRACES.get(name, "a Mooncake .jsonl or Azure .csv request trace")


def check_trace_files(paths: Iterable[str]) -> None:
  """Raises FileNotFoundError for the first missing file, naming it and its origin."""
  for path in paths:
    if not os.path.exists(path):
      raise FileNotFoundError(f"trace file {path} not found; it is {describe_trace(path)}")


def load_mooncake(path: str, max_requests: int = 0) -> list[TraceRequest]:
  """Reads a Mooncake JSONL trace (timestamps in ms); the first ``max_requests`` if > 0."""
  out = []
  with open(path) as f:
    for line in f:
      if not line.strip():
        continue
      row = json.loads(line)
      hash_ids = np.asarray(row["hash_ids"], np.int64).reshape(-1)
      n = -(-int(row["input_length"]) // MOONCAKE_BLOCK_TOKENS)
      if hash_ids.shape[0] != n:
        raise ValueError(
            f"{path}: row {len(out)} has {hash_ids.shape[0]} hash ids "
            f"for input_length {row['input_length']} (want {n})"
        )
      out.append(
          TraceRequest(
              row["timestamp"] / 1000.0,
              int(row["input_length"]),
              int(row["output_length"]),
              hash_ids,
          )
      )
      if max_requests and len(out) >= max_requests:
        break
  return out


def _parse_azure_time(text: str) -> float:
  base, _, frac = text.strip().partition(".")
  t = datetime.datetime.strptime(base, "%Y-%m-%d %H:%M:%S").timestamp()
  return t + (float("0." + frac) if frac else 0.0)


def load_azure(path: str, max_requests: int = 0) -> list[TraceRequest]:
  """Reads an Azure LLM inference CSV trace (length-only); times from the first row."""
  out = []
  with open(path) as f:
    header = [h.strip() for h in f.readline().split(",")]
    col = {name: i for i, name in enumerate(header)}
    for name in ("TIMESTAMP", "ContextTokens", "GeneratedTokens"):
      if name not in col:
        raise ValueError(f"{path}: missing column {name} in header {header}")
    t0 = None
    for line in f:
      if not line.strip():
        continue
      cells = line.split(",")
      t = _parse_azure_time(cells[col["TIMESTAMP"]])
      t0 = t if t0 is None else t0
      out.append(
          TraceRequest(
              t - t0, int(cells[col["ContextTokens"]]), int(cells[col["GeneratedTokens"]])
          )
      )
      if max_requests and len(out) >= max_requests:
        break
  return out


def load_trace(path: str, max_requests: int = 0) -> list[TraceRequest]:
  """Reads a trace by extension: Mooncake ``.jsonl`` or Azure ``.csv``.

  Raises:
    FileNotFoundError: no such file (for a known public trace, says where to get it).
    ValueError: an unknown extension or a malformed row.
  """
  if not path.endswith((".jsonl", ".csv")):
    raise ValueError(f"unknown trace format (want .jsonl or .csv): {path}")
  check_trace_files([path])
  if path.endswith(".jsonl"):
    return load_mooncake(path, max_requests)
  return load_azure(path, max_requests)


_BLOCK_OFFSETS = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.int64)


def mooncake_tokens(hash_ids: np.ndarray, input_length: int) -> np.ndarray:
  """i32[input_length]: block hash ``h`` -> token ids ``h * 512 + j``, last block cut."""
  if hash_ids.size and int(hash_ids.max()) >= (2**31) // MOONCAKE_BLOCK_TOKENS:
    raise ValueError("hash id too large for int32 token ids")
  tokens = (hash_ids[:, None] * MOONCAKE_BLOCK_TOKENS + _BLOCK_OFFSETS).reshape(-1)
  return tokens[:input_length].astype(np.int32)


class TokenSource:
  """Expands requests into token ids; unique ids (above every Mooncake-derived id of
  ``requests``, so they match nothing) for content without prefix info."""

  def __init__(self, requests: Iterable[TraceRequest]):
    top = max(
        (int(r.hash_ids.max()) for r in requests if r.hash_ids is not None and r.hash_ids.size),
        default=-1,
    )
    self._next_unique = (top + 1) * MOONCAKE_BLOCK_TOKENS

  def unique(self, n: int) -> np.ndarray:
    """i32[n] token ids never handed out before."""
    if self._next_unique + n >= 2**31:
      raise OverflowError("ran out of int32 token ids for unique tokens")
    out = np.arange(self._next_unique, self._next_unique + n, dtype=np.int32)
    self._next_unique += n
    return out

  def prompt(self, request: TraceRequest) -> np.ndarray:
    """i32[input_length] prompt token ids (unique ones without hash ids)."""
    if request.hash_ids is None:
      return self.unique(request.input_length)
    return mooncake_tokens(request.hash_ids, request.input_length)


def scaled_prompt(request: TraceRequest, tokens: TokenSource, scale: int) -> np.ndarray:
  """i32[ceil(input_length / scale)] prompt ids; a hash block becomes ``512 // scale``
  tokens, so the prefix structure is kept."""
  n = max(1, -(-request.input_length // scale))
  if request.hash_ids is None:
    return tokens.unique(n)
  per_block = MOONCAKE_BLOCK_TOKENS // scale
  ids = (
      request.hash_ids[:, None] * per_block + np.arange(per_block, dtype=np.int64)[None, :]
  ).reshape(-1)
  return ids[:n].astype(np.int32)


def exact_hit_bound(requests: Iterable[TraceRequest]) -> tuple[int, int]:
  """(hit tokens, prompt tokens) of an unlimited token-level prefix cache.

  Each request hits ``max over earlier requests p`` of ``min(512 * d_p, L, L_p)``,
  ``d_p`` = leading hash ids shared with ``p``; since a hash id names a block and its
  whole prefix, the longest earlier prompt holding each block suffices.
  """
  longest: dict[int, int] = {}
  hit = total = 0
  for r in requests:
    total += r.input_length
    if r.hash_ids is None:
      continue
    ids = r.hash_ids.tolist()
    best = 0
    for d, h in enumerate(ids, start=1):
      prev = longest.get(h)
      if prev is None:
        break
      best = max(best, min(MOONCAKE_BLOCK_TOKENS * d, r.input_length, prev))
    hit += best
    for h in ids:
      if longest.get(h, -1) < r.input_length:
        longest[h] = r.input_length
  return hit, total

"""Small synthetic traces, in memory and as files in the public formats, for tests.

The tests never read ``../shared/traces``: a test that needs a trace file writes one
here, in the same format (``paged_kv.sim.traces`` documents both):

* Mooncake JSONL: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``,
  one object per line, ``len(hash_ids) == ceil(input_length / 512)``;
* Azure CSV: header ``TIMESTAMP,ContextTokens,GeneratedTokens``, absolute times
  ``2023-11-16 18:15:46.6805900``.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import unittest

import numpy as np

from paged_kv.sim.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest

BLOCK = MOONCAKE_BLOCK_TOKENS


def session_trace(seed: int, num: int = 120, num_sessions: int = 12, *,
                  partial: bool = False, gap_s: float = 0.5) -> list[TraceRequest]:
  """Multi-turn sessions: each turn extends the session's previous prompt.

  Every prompt starts with hash 0 (a shared system block, as in the Mooncake trace).
  With ``partial`` the last block of a prompt is cut to a random length, as in real
  traces. Arrival times are ``gap_s`` apart (whole milliseconds).
  """
  rng = np.random.default_rng(seed)
  next_hash = 1
  sessions: list[list[int]] = [[] for _ in range(num_sessions)]
  out = []
  for i in range(num):
    s = int(rng.integers(num_sessions))
    grow = int(rng.integers(1, 4))
    sessions[s] = sessions[s] + list(range(next_hash, next_hash + grow))
    next_hash += grow
    hashes = [0] + sessions[s]
    length = BLOCK * len(hashes)
    if partial:
      length -= int(rng.integers(0, BLOCK))
    out.append(TraceRequest(round(i * gap_s, 3), length, int(rng.integers(1, 200)),
                            np.asarray(hashes, np.int64)))
  return out


def write_mooncake(path: os.PathLike | str, requests: list[TraceRequest]) -> str:
  """Writes ``requests`` (all with hash ids) as a Mooncake JSONL file; returns the path."""
  with open(path, "w") as f:
    for r in requests:
      row = {"timestamp": int(round(r.arrival_s * 1000)), "input_length": r.input_length,
             "output_length": r.output_length, "hash_ids": [int(h) for h in r.hash_ids]}
      f.write(json.dumps(row) + "\n")
  return str(path)


def write_azure(path: os.PathLike | str, requests: list[TraceRequest],
                start: str = "2023-11-16 18:15:46") -> str:
  """Writes ``requests`` as an Azure CSV file (7-digit fractional seconds); returns the path."""
  t0 = datetime.datetime.strptime(start, "%Y-%m-%d %H:%M:%S")
  with open(path, "w") as f:
    f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    for r in requests:
      t = t0 + datetime.timedelta(microseconds=round(r.arrival_s * 1e6))
      f.write(f"{t:%Y-%m-%d %H:%M:%S}.{t.microsecond:06d}0,{r.input_length},{r.output_length}\n")
  return str(path)


def tmp_file(test: unittest.TestCase, name: str, content: str = "") -> str:
  """A file in a directory removed after ``test`` (works under pytest and absltest)."""
  tmp = test.enterContext(tempfile.TemporaryDirectory())
  path = os.path.join(tmp, name)
  with open(path, "w") as f:
    f.write(content)
  return path

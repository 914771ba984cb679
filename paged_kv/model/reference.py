"""The dense no-cache reference that paged generation is checked against, token for token.

  * `generate_dense` — greedy generation recomputing every sequence each step.
  * `dense_mismatches` — teacher-forces a paged token history through the dense
    model and lists every sampled token that differs from its greedy choice.

Both take any model with `dense(tokens, positions, valid)` (see
`paged_kv.model.llama.dense_forward`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from paged_kv.model import llama
from paged_kv.model.ragged import bucket
from paged_kv.model.runner import SequenceRecord


def generate_dense(model: llama.TinyLlama, prompts: Sequence[Sequence[int]],
                   max_new_tokens: int) -> list[list[int]]:
  """Greedy generation through the dense reference (recomputes every sequence each step).

  Returns each prompt followed by its `max_new_tokens` greedy tokens.
  """
  seqs = [list(map(int, p)) for p in prompts]
  width = bucket(max(len(s) for s in seqs) + max_new_tokens)
  for _ in range(max_new_tokens):
    toks = np.zeros((len(seqs), width), np.int32)
    lens = np.array([len(s) for s in seqs], np.int32)
    for i, s in enumerate(seqs):
      toks[i, :len(s)] = s
    logits = np.asarray(llama.dense_forward(model, toks, lens))
    for i, s in enumerate(seqs):
      s.append(int(np.argmax(logits[i, len(s) - 1])))
  return seqs


def dense_mismatches(model: llama.TinyLlama,
                     records: Sequence[SequenceRecord]) -> list[tuple[int, int, int, int]]:
  """Positions where a paged sample differs from the dense greedy choice.

  Teacher-forces each record's token history through the dense reference and
  compares every model-sampled token with the reference's argmax after the
  tokens before it (forced tokens and prompts are inputs only). Equal to greedy
  dense generation token for token when the list is empty.

  Returns:
    `(record index, position, paged token, dense token)` per mismatch.
  """
  width = bucket(max(len(r.tokens) for r in records))
  toks = np.zeros((len(records), width), np.int32)
  lens = np.array([len(r.tokens) for r in records], np.int32)
  for i, r in enumerate(records):
    toks[i, :len(r.tokens)] = r.tokens
  logits = np.asarray(llama.dense_forward(model, toks, lens))
  out = []
  for i, r in enumerate(records):
    for p in range(1, len(r.tokens)):
      if r.sampled[p]:
        want = int(np.argmax(logits[i, p - 1]))
        if want != r.tokens[p]:
          out.append((i, p, r.tokens[p], want))
  return out

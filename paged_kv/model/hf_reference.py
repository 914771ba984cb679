"""Hugging Face transformers as the reference for paged_kv's greedy tokens (torch only, no JAX).

`Reference(dir)` loads a checkpoint with `AutoModelForCausalLM` (its dtype, on
CUDA when present). `greedy` runs transformers' own greedy generation (equal
prompt lengths batched, no EOS stop) for `compare`; `check` is teacher-forced: a
token is off when transformers' best logit at its position beats it by more than
`tie_tolerance` standard deviations, which tells bf16 near-ties (rounded apart
by the two implementations) from wrong tokens.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import importlib.util
import os
import time
from typing import Sequence

__all__ = ["GreedyResult", "Reference", "TokenCheck", "available", "compare"]


def available() -> str | None:
  """None when torch and transformers are importable, else why not."""
  missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
  return f"{' and '.join(missing)} not installed" if missing else None


@dataclasses.dataclass(frozen=True)
class GreedyResult:
  """Each request's greedy output tokens, and the generation's wall time."""

  outputs: list[list[int]]
  seconds: float


@dataclasses.dataclass(frozen=True)
class TokenCheck:
  """Teacher-forced check: tokens checked, and `(request, position, gap in std)` of those off."""

  tokens: int
  off: list[tuple[int, int, float]]
  tie_tolerance: float


class Reference:
  """A checkpoint in transformers: its torch `device`, `dtype` and transformers `version`."""

  def __init__(self, path: str | os.PathLike, *, device: str | None = None):
    import torch  # pylint: disable=import-outside-toplevel
    import transformers  # pylint: disable=import-outside-toplevel
    self._torch = torch
    self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype="auto")
    self.model = model.to(self.device).eval()
    self.dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
    self.version = transformers.__version__

  def _sync(self) -> None:
    if self.device.startswith("cuda"):
      self._torch.cuda.synchronize()

  def greedy(self, prompts: Sequence[Sequence[int]], output_lens: Sequence[int], *,
             batch_size: int = 64) -> GreedyResult:
    """transformers' greedy outputs, `output_lens[i]` tokens for prompt i."""
    torch = self._torch
    config = copy.deepcopy(self.model.generation_config)
    config.eos_token_id = None  # random weights: never stop early
    config.pad_token_id = 0
    config.do_sample = False
    config.max_new_tokens = None
    for name in ("temperature", "top_p", "top_k"):
      setattr(config, name, None)
    groups = collections.defaultdict(list)
    for i, p in enumerate(prompts):
      groups[len(p)].append(i)
    outputs: list[list[int]] = [[] for _ in prompts]
    seconds = 0.0
    with torch.inference_mode():
      for length, members in sorted(groups.items()):
        for start in range(0, len(members), batch_size):
          idx = members[start:start + batch_size]
          ids = torch.tensor([list(map(int, prompts[i])) for i in idx], device=self.device)
          config.max_new_tokens = max(int(output_lens[i]) for i in idx)
          self._sync()
          t0 = time.perf_counter()
          out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                    generation_config=config)
          self._sync()
          seconds += time.perf_counter() - t0
          for row, i in enumerate(idx):
            outputs[i] = out[row, length:length + int(output_lens[i])].tolist()
    return GreedyResult(outputs, seconds)

  def check(self, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], *,
            tie_tolerance: float = 0.1, batch_size: int = 16) -> TokenCheck:
    """Teacher-forced check of `outputs` (see the module docstring)."""
    torch = self._torch
    groups = collections.defaultdict(list)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
      if len(o):
        groups[(len(p), len(o))].append(i)
    tokens, off = 0, []
    with torch.inference_mode():
      for (plen, olen), members in sorted(groups.items()):
        for start in range(0, len(members), batch_size):
          idx = members[start:start + batch_size]
          seqs = [list(map(int, prompts[i])) + list(map(int, outputs[i]))[:-1] for i in idx]
          ids = torch.tensor(seqs, device=self.device)
          logits = self.model(ids, logits_to_keep=olen).logits.float()  # [B, olen, V]
          ours = torch.tensor([list(map(int, outputs[i])) for i in idx], device=self.device)
          mine = torch.gather(logits, 2, ours[..., None])[..., 0]
          gap = (logits.max(-1).values - mine) / logits.std(-1)
          tokens += gap.numel()
          for row, pos in (gap > tie_tolerance).nonzero().tolist():
            off.append((idx[row], pos, float(gap[row, pos])))
    return TokenCheck(tokens, sorted(off), tie_tolerance)

  def close(self) -> None:
    """Frees the model (and the GPU memory it held)."""
    del self.model
    if self.device.startswith("cuda"):
      self._torch.cuda.empty_cache()


def compare(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]
            ) -> tuple[int, list[tuple[int, int]]]:
  """`(requests equal in full, [(request, first differing position)] of the others)`."""
  equal, diffs = 0, []
  for i, (a, b) in enumerate(zip(ours, theirs)):
    a, b = list(a), list(b)
    if a == b:
      equal += 1
      continue
    diffs.append((i, next((k for k, (x, y) in enumerate(zip(a, b)) if x != y),
                          min(len(a), len(b)))))
  return equal, diffs

"""RoPE inverse frequencies, with the scalings Hugging Face Llama-family configs state.

Without scaling `apply_rope` uses `theta ** (-i / half)`; with a `RopeScaling`,
`inverse_frequencies` as transformers computes them (float32, same order):

  "linear"  inv_freq / factor
  "llama3"  with wavelen = 2 pi / inv_freq, L = original_max_position_embeddings:
            wavelengths above L / low_freq_factor divided by `factor`, below
            L / high_freq_factor kept, between: (1 - s) * inv_freq / factor +
            s * inv_freq, s = (L / wavelen - low_freq_factor) / (high_freq_factor
            - low_freq_factor).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from paged_kv.core.errors import InvalidArgument

__all__ = ["RopeScaling", "SUPPORTED_ROPE_TYPES", "inverse_frequencies"]

SUPPORTED_ROPE_TYPES = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A RoPE scaling (frozen, hashable): "linear" or "llama3" with `factor > 0`.

  "llama3" also needs `high_freq_factor > low_freq_factor > 0` and the
  pre-training context `original_max_position_embeddings`.
  """

  rope_type: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type not in SUPPORTED_ROPE_TYPES:
      raise InvalidArgument(f"RoPE scaling type {self.rope_type!r} is not implemented "
                            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if not isinstance(self.factor, (int, float)) or not self.factor > 0:
      raise InvalidArgument(f"RoPE scaling factor must be a number > 0, got {self.factor!r}")
    if self.rope_type == "llama3":
      low, high = self.low_freq_factor, self.high_freq_factor
      if not (isinstance(low, (int, float)) and isinstance(high, (int, float))
              and 0 < low < high):
        raise InvalidArgument(f"llama3 RoPE scaling needs 0 < low_freq_factor < "
                              f"high_freq_factor, got {low!r} and {high!r}")
      orig = self.original_max_position_embeddings
      if not isinstance(orig, int) or orig <= 0:
        raise InvalidArgument(f"llama3 RoPE scaling needs original_max_position_embeddings "
                              f"> 0, got {orig!r}")


def inverse_frequencies(head_dim: int, *, theta: float,
                        scaling: RopeScaling | None = None) -> np.ndarray:
  """`f32[head_dim // 2]` RoPE inverse frequencies by `scaling`, in transformers' float32 order."""
  if head_dim <= 0 or head_dim % 2:
    raise InvalidArgument(f"head_dim must be even and > 0 for RoPE, got {head_dim}")
  exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  inv_freq = np.float32(1.0) / (np.float32(theta) ** exponent)
  if scaling is None:
    return inv_freq.astype(np.float32)
  factor = np.float32(scaling.factor)
  if scaling.rope_type == "linear":
    return (inv_freq / factor).astype(np.float32)
  # llama3
  low, high = np.float32(scaling.low_freq_factor), np.float32(scaling.high_freq_factor)
  old_context = np.float32(scaling.original_max_position_embeddings)
  low_freq_wavelen = old_context / low
  high_freq_wavelen = old_context / high
  wavelen = np.float32(2 * math.pi) / inv_freq
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
  smooth = (old_context / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)

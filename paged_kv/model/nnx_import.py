"""`flax.nnx` for the model layer's modules, or an import error naming the extra.

The model layer's NNX modules (`PagedAttention`, the reference model, the jitted
steps, `ModelExecutor`) need flax, which the core does not: it is the `model` extra.
Without it they raise `ModuleNotFoundError` saying how to install it, instead of a
bare "No module named 'flax'".
"""

from __future__ import annotations

try:
  from flax import nnx
except ModuleNotFoundError as err:
  if err.name not in ("flax", "flax.nnx"):
    raise
  raise ModuleNotFoundError(
      "paged_kv's model layer (PagedAttention, TinyLlama, the jitted steps, ModelExecutor) "
      "needs flax; install it with: pip install 'paged-kv[model]'", name="flax") from err

__all__ = ["nnx"]

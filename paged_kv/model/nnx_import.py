"""`flax.nnx` for the model layer's modules, or a `ModuleNotFoundError` naming the `model` extra."""

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

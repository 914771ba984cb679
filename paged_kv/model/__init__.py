"""What model code imports: per-step metadata, paged attention, NNX layers, jitted steps.

`StepPlan`, `StepMetadata`, `paged_attention`, the model contract, `ragged` and
`rope` need only JAX; the names from the flax modules (`PagedAttention`, the
Llama model, the jitted steps, checkpoints, tokenizer) load on first use, so
`import paged_kv.model` does not import flax. Map: `docs/architecture.md`.
"""

from __future__ import annotations

import importlib

from paged_kv.model.attention import default_impl, paged_attention, resolve_impl
from paged_kv.model.contract import ModelContractError, PagedModel, check_model
from paged_kv.model.metadata import StepMetadata
from paged_kv.model.plan import StepPlan
from paged_kv.model.ragged import last_token_index
from paged_kv.model.rope import RopeScaling

# Names that live in modules importing flax, loaded lazily (PEP 562).
_LAZY = {
    "PagedAttention": "layers", "apply_rope": "layers", "causal_attention": "layers",
    "LlamaConfig": "llama", "TinyLlama": "llama", "dense_forward": "llama",
    "pool_config_for": "llama", "check_pool_matches_model": "llama",
    "forward": "steps", "prefill": "steps", "decode_step": "steps", "decode_multi": "steps",
    "ModelSteps": "steps", "bind": "steps",
    "PagedRunner": "runner", "SequenceRecord": "runner", "generate_paged": "runner",
    "generate_dense": "reference", "dense_mismatches": "reference",
}

__all__ = ["ModelContractError", "PagedModel", "StepMetadata", "StepPlan", "check_model",
           "RopeScaling", "default_impl", "last_token_index", "paged_attention", "resolve_impl",
           *_LAZY]


def __getattr__(name: str):
  if name in _LAZY:
    return getattr(importlib.import_module(f"paged_kv.model.{_LAZY[name]}"), name)
  raise AttributeError(f"module 'paged_kv.model' has no attribute {name!r}")

"""What model code imports: per-step metadata, paged attention, NNX layers, jitted steps.

  paged_kv.model.plan       StepPlan: the rows and ragged tokens of one forward pass
  paged_kv.model.metadata   StepMetadata: positions, slot_mapping, cu_q_lens, segment
                            tables, decode/prefill counts (built on host or in jit)
  paged_kv.model.attention  paged_attention (write K/V + attend, mixed batch), default_impl
  paged_kv.model.contract   the model contract ModelExecutor calls: PagedModel, check_model
  paged_kv.model.ragged     the ragged token layout helpers (`last_token_index`: each
                            row's last token in the ragged batch, whose logits sample)
  paged_kv.model.layers     PagedAttention (Flax NNX), apply_rope, causal_attention
  paged_kv.model.rope       RopeScaling, inverse_frequencies (Hugging Face's RoPE scalings)
  paged_kv.model.llama      the Llama-family reference model (TinyLlama), dense_forward
  paged_kv.model.steps      jitted forward / prefill / decode_step / decode_multi;
                            bind(model, config) -> ModelSteps: the same, built once
                            (the fast path: a call hashes nothing, flat in depth)
  paged_kv.model.multistep  scan_decode: k decode steps in one program (which rows run)
  paged_kv.model.runner     PagedRunner, generate_paged (host driver for tests, demos)
  paged_kv.model.reference  generate_dense, dense_mismatches (the dense reference)
  paged_kv.model.hf_checkpoint  load_checkpoint: a Hugging Face Llama/Mistral/Qwen2
                            checkpoint into TinyLlama (the `hf` extra: safetensors)
  paged_kv.model.tokenizer  Tokenizer over a tokenizer.json (the `hf` extra: tokenizers)
  paged_kv.model.random_checkpoint  a random checkpoint with a real model's shape, written
                            as transformers names it (numpy + safetensors)
  paged_kv.model.hf_reference  transformers on the same checkpoint: greedy generate and a
                            teacher-forced check of our tokens (torch, transformers)

The first five (and `rope`) need only JAX; the names from the others (which need flax) are
loaded on first use, so `import paged_kv.model` does not import flax.
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

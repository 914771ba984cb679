"""Tiny random Hugging Face checkpoints and tokenizers, written by the tests themselves.

`write_checkpoint(dir, hf_config)` writes `config.json` and random weights under the
tensor names and `[out, in]` shapes of transformers' Llama-family models (from the
config alone, not from paged_kv's mapping), optionally as bf16/f16 and in shards
with a `model.safetensors.index.json`. `write_tokenizer(dir, texts)` trains a small
byte-level BPE `tokenizer.json` in memory with the `tokenizers` library. Both need
the `hf` extra; callers `pytest.importorskip` it first.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Three configs in the layouts of the three families (tiny sizes).
LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=320,
             hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
             max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=256),
             tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
             bos_token_id=1, eos_token_id=2, torch_dtype="float32")
MISTRAL = dict(model_type="mistral", architectures=["MistralForCausalLM"], vocab_size=320,
               hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=1, head_dim=24, hidden_act="silu",
               max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0,
               sliding_window=None, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2, torch_dtype="bfloat16")
QWEN2 = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=320,
             hidden_size=48, intermediate_size=80, num_hidden_layers=3,
             num_attention_heads=6, num_key_value_heads=2, hidden_act="silu",
             max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
             rope_scaling=dict(type="linear", factor=4.0), use_sliding_window=False,
             sliding_window=4096, max_window_layers=28, tie_word_embeddings=True,
             bos_token_id=None, eos_token_id=2, torch_dtype="float16")


def head_dim(hf: dict) -> int:
  return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def hf_weights(hf: dict, *, seed: int) -> dict[str, np.ndarray]:
  """Random float32 weights under transformers' names and `[out, in]` shapes."""
  rng = np.random.default_rng(seed)
  h, i, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
  d = head_dim(hf)
  q, kv = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d
  bias = hf["model_type"] == "qwen2" or hf.get("attention_bias", False)
  out_bias = hf["model_type"] == "llama" and hf.get("attention_bias", False)
  lin = lambda o, n: rng.normal(0.0, 1.0 / np.sqrt(n), (o, n)).astype(np.float32)
  norm = lambda n: (1.0 + 0.1 * rng.normal(size=n)).astype(np.float32)
  w = {"model.embed_tokens.weight": rng.normal(size=(v, h)).astype(np.float32)}
  for layer in range(hf["num_hidden_layers"]):
    p = f"model.layers.{layer}"
    w[f"{p}.input_layernorm.weight"] = norm(h)
    w[f"{p}.self_attn.q_proj.weight"] = lin(q, h)
    w[f"{p}.self_attn.k_proj.weight"] = lin(kv, h)
    w[f"{p}.self_attn.v_proj.weight"] = lin(kv, h)
    w[f"{p}.self_attn.o_proj.weight"] = lin(h, q)
    if bias:
      for name, n in (("q", q), ("k", kv), ("v", kv)):
        w[f"{p}.self_attn.{name}_proj.bias"] = (0.1 * rng.normal(size=n)).astype(np.float32)
    if out_bias:
      w[f"{p}.self_attn.o_proj.bias"] = (0.1 * rng.normal(size=h)).astype(np.float32)
    w[f"{p}.post_attention_layernorm.weight"] = norm(h)
    w[f"{p}.mlp.gate_proj.weight"] = lin(i, h)
    w[f"{p}.mlp.up_proj.weight"] = lin(i, h)
    w[f"{p}.mlp.down_proj.weight"] = lin(h, i)
  w["model.norm.weight"] = norm(h)
  if not hf.get("tie_word_embeddings", False):
    w["lm_head.weight"] = lin(v, h)
  return w


def _stored(x: np.ndarray, dtype: str) -> np.ndarray:
  if dtype == "bfloat16":
    import ml_dtypes  # pylint: disable=import-outside-toplevel
    return x.astype(ml_dtypes.bfloat16)
  return x.astype(np.dtype(dtype))


def write_checkpoint(path: Path, hf: dict, *, seed: int = 0, dtype: str | None = None,
                     shards: int = 1, weights: dict | None = None,
                     extra: dict | None = None) -> dict[str, np.ndarray]:
  """Writes a checkpoint directory; returns the weights as stored, in float32.

  Args:
    path: the directory (created).
    hf: the config.json dict.
    seed: the weights' seed (ignored with `weights`).
    dtype: the tensors' dtype (default: the config's `torch_dtype`).
    shards: files to split the tensors over (> 1 writes the index).
    weights: tensors to write instead of random ones (tests drop or add some).
    extra: `{file: dict}` more JSON files (generation_config.json, ...).
  """
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  weights = hf_weights(hf, seed=seed) if weights is None else weights
  dtype = dtype or hf.get("torch_dtype", "float32")
  stored = {k: (_stored(x, dtype) if x.dtype.kind == "f" else x) for k, x in weights.items()}
  (path / "config.json").write_text(json.dumps(hf, indent=2))
  names = list(stored)
  if shards == 1:
    save_file(stored, str(path / "model.safetensors"))
  else:
    weight_map = {}
    for s in range(shards):
      file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
      part = {n: stored[n] for n in names[s::shards]}
      save_file(part, str(path / file))
      weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
  for file, data in (extra or {}).items():
    (path / file).write_text(json.dumps(data, indent=2))
  return {k: np.asarray(x, np.float32) if x.dtype.kind == "f" or x.dtype.itemsize == 2 else x
          for k, x in stored.items()}


TEXTS = ["the quick brown fox jumps over the lazy dog",
         "paged attention keeps the kv cache in blocks",
         "a tiny tokenizer for a tiny model, trained in memory",
         "héllo wörld: unicode survives the byte-level round trip"]


def write_tokenizer(path: Path, *, vocab_size: int = 300, texts=TEXTS) -> None:
  """A byte-level BPE `tokenizer.json` (specials `<unk>`=0, `<s>`=1, `</s>`=2; BOS added)."""
  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator(list(texts), trainer)
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                     special_tokens=[("<s>", 1)])
  Path(path).mkdir(parents=True, exist_ok=True)
  tok.save(str(Path(path) / "tokenizer.json"))

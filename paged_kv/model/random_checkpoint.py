"""Random Hugging Face Llama checkpoints with real models' shapes (`SHAPES`), written on the fly.

Written under transformers' names and shapes, readable by `load_checkpoint` and
transformers alike; each tensor seeded on its own (linear `N(0, 1) /
sqrt(fan_in)`, embedding `N(0, 1)`, norms `1 + 0.1 N(0, 1)`). numpy,
safetensors and ml_dtypes only; `write_byte_level_tokenizer` adds a tokenizer.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
from pathlib import Path

import numpy as np

__all__ = ["SHAPES", "hf_config", "num_parameters", "tensor_specs", "write_random_checkpoint",
           "write_byte_level_tokenizer"]

_LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               attention_bias=False, attention_dropout=0.0, mlp_bias=False,
               initializer_range=0.02, pretraining_tp=1, use_cache=True,
               max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
               bos_token_id=128000, eos_token_id=128001, vocab_size=128256)

SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(
        _LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "llama-3.1-8b": dict(
        _LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "tiny": dict(
        _LLAMA3, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        vocab_size=512, bos_token_id=1, eos_token_id=2, max_position_embeddings=4096,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=256)),
}
"""`config.json` of each shape, without its dtype (`hf_config` adds it)."""

_DTYPES = ("bfloat16", "float16", "float32")
_MAX_SHARD_BYTES = 5 << 30  # transformers' default shard size for `save_pretrained`


def hf_config(shape: str, *, dtype: str = "bfloat16", **overrides) -> dict:
  """The `config.json` dict of a shape in `SHAPES`, stored as `dtype`, with `overrides`."""
  if shape not in SHAPES:
    raise ValueError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
  if dtype not in _DTYPES:
    raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
  return dict(SHAPES[shape], torch_dtype=dtype, **overrides)


def tensor_specs(hf: dict) -> list[tuple[str, tuple[int, ...], str]]:
  """`(name, [out, in] shape, kind)` of every tensor, kind "embed", "linear" or "norm"."""
  if hf.get("model_type") != "llama" or hf.get("attention_bias") or hf.get("mlp_bias"):
    raise ValueError("only bias-free Llama configs (model_type llama) are written here")
  h, i, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
  d = hf.get("head_dim") or h // hf["num_attention_heads"]
  q, kv = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d
  specs = [("model.embed_tokens.weight", (v, h), "embed")]
  for layer in range(hf["num_hidden_layers"]):
    p = f"model.layers.{layer}"
    specs += [(f"{p}.input_layernorm.weight", (h,), "norm"),
              (f"{p}.self_attn.q_proj.weight", (q, h), "linear"),
              (f"{p}.self_attn.k_proj.weight", (kv, h), "linear"),
              (f"{p}.self_attn.v_proj.weight", (kv, h), "linear"),
              (f"{p}.self_attn.o_proj.weight", (h, q), "linear"),
              (f"{p}.post_attention_layernorm.weight", (h,), "norm"),
              (f"{p}.mlp.gate_proj.weight", (i, h), "linear"),
              (f"{p}.mlp.up_proj.weight", (i, h), "linear"),
              (f"{p}.mlp.down_proj.weight", (h, i), "linear")]
  specs.append(("model.norm.weight", (h,), "norm"))
  if not hf.get("tie_word_embeddings", False):
    specs.append(("lm_head.weight", (v, h), "linear"))
  return specs


def num_parameters(hf: dict) -> int:
  """Parameters of the checkpoint (a tied head counted once)."""
  return sum(math.prod(shape) for _, shape, _ in tensor_specs(hf))


def _numpy_dtype(dtype: str):
  if dtype == "bfloat16":
    import ml_dtypes  # pylint: disable=import-outside-toplevel
    return ml_dtypes.bfloat16
  return np.dtype(dtype)


def _tensor(seed: int, index: int, shape: tuple[int, ...], kind: str, dtype) -> np.ndarray:
  rng = np.random.default_rng([seed, index])
  x = rng.standard_normal(shape, dtype=np.float32)
  if kind in ("linear", "embed"):
    x *= np.float32(1.0 / math.sqrt(shape[1]))
  elif kind == "norm":
    x *= np.float32(0.1)
    x += np.float32(1.0)
  return x.astype(dtype, copy=False)


def write_random_checkpoint(path: str | os.PathLike, hf: dict, *, seed: int = 0,
                            max_shard_bytes: int = _MAX_SHARD_BYTES,
                            threads: int | None = None) -> Path:
  """Writes a random checkpoint of config `hf` into directory `path`; returns it.

  Shards of at most `max_shard_bytes` with an index, as transformers writes them;
  `config.json` goes last, so a directory with one is complete. Tensors are drawn
  on `threads` threads (default up to 8); memory peaks at about one shard.
  """
  try:
    from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  except ModuleNotFoundError as err:
    raise ModuleNotFoundError("writing a checkpoint needs safetensors; install it with: "
                              "pip install 'paged-kv[hf]'", name="safetensors") from err
  dtype_name = hf.get("torch_dtype", hf.get("dtype", "float32"))
  if dtype_name not in _DTYPES:
    raise ValueError(f"torch_dtype must be one of {_DTYPES}, got {dtype_name!r}")
  dtype = _numpy_dtype(dtype_name)
  itemsize = np.dtype(dtype).itemsize
  specs = list(enumerate(tensor_specs(hf)))
  shards: list[list] = [[]]
  size = 0
  for item in specs:
    nbytes = math.prod(item[1][1]) * itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(item)
    size += nbytes
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  for old in ("config.json", "model.safetensors.index.json", *(
      p.name for p in path.glob("model*.safetensors"))):
    (path / old).unlink(missing_ok=True)
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
  weight_map = {}
  workers = threads or min(8, os.cpu_count() or 1)
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    for name, shard in zip(names, shards):
      arrays = pool.map(lambda item: _tensor(seed, item[0], item[1][1], item[1][2], dtype),
                        shard)
      tensors = {spec[0]: x for (_, spec), x in zip(shard, arrays)}
      save_file(tensors, str(path / name), metadata={"format": "pt"})
      weight_map.update({n: name for n in tensors})
      del tensors
  if len(shards) > 1:
    total = sum(math.prod(s[1]) for _, s in specs) * itemsize
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
  (path / "config.json").write_text(json.dumps(hf, indent=2))
  return path


_CORPUS = ("a paged kv cache keeps the keys and values of every token in fixed blocks",
           "the scheduler batches prompts and decodes in one forward pass per step")


def write_byte_level_tokenizer(path: str | os.PathLike, vocab_size: int) -> Path:
  """Writes a byte-level BPE `tokenizer.json` of `vocab_size` ids into `path`; returns the file.

  Specials `<unk>`, `<s>`, `</s>`; any text encodes. Raises `ValueError` for a
  `vocab_size` below 259.
  """
  try:
    # pylint: disable=import-outside-toplevel
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  except ModuleNotFoundError as err:
    raise ModuleNotFoundError("writing a tokenizer needs tokenizers; install it with: "
                              "pip install 'paged-kv[hf]'", name="tokenizers") from err
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + 3:
    raise ValueError(f"vocab_size={vocab_size} is below the {len(alphabet)} bytes plus 3 "
                     f"special tokens of a byte-level tokenizer")
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(list(_CORPUS) * 8, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
      initial_alphabet=alphabet, show_progress=False))
  out = Path(path) / "tokenizer.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  tok.save(str(out))
  return out

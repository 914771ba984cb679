"""Hugging Face Llama-family checkpoints (Llama, Mistral, Qwen2) into the reference model.

`load_checkpoint(dir)` maps a transformers checkpoint directory onto `TinyLlama`
(same formulas); the name tables, what is refused and precision notes are in
`docs/model.md`. Needs the `hf` extra (safetensors) and flax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from paged_kv.core.errors import InvalidArgument
from paged_kv.model import optional_import
from paged_kv.model.rope import SUPPORTED_ROPE_TYPES, RopeScaling

__all__ = ["CheckpointMismatch", "HFCheckpoint", "UnsupportedCheckpoint", "load_checkpoint",
           "llama_config_from_hf", "read_hf_config", "tensor_names"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
           "bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16",
           "float": "float32"}
_TENSOR_DTYPES = ("BF16", "F16", "F32")
_MAX_NAMED = 8  # names listed in an error before "... and N more"


class UnsupportedCheckpoint(InvalidArgument):
  """The checkpoint's config asks for something the reference model does not compute."""


class CheckpointMismatch(InvalidArgument):
  """The checkpoint's tensors do not match its config (missing, unexpected, misshapen)."""


def _safetensors():
  return optional_import.require("safetensors", needed_for="loading a Hugging Face checkpoint",
                                 extra="hf")


def _listed(names) -> str:
  names = sorted(names)
  more = f" ... and {len(names) - _MAX_NAMED} more" if len(names) > _MAX_NAMED else ""
  return ", ".join(names[:_MAX_NAMED]) + more


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
  """A loaded checkpoint: the `TinyLlama` `model`, its `LlamaConfig`, and config.json's facts.

  `max_seq_len` is the longest sequence (prompt + output) it may serve: the one
  asked for, else `max_position_embeddings`; `eos_token_ids` is `()` if none.
  """

  model: Any
  config: Any
  model_type: str
  max_seq_len: int
  bos_token_id: int | None
  eos_token_ids: tuple[int, ...]
  path: Path


def read_hf_config(path: str | os.PathLike) -> dict:
  """`config.json` of a checkpoint directory, as a dict."""
  file = Path(path) / "config.json"
  if not file.is_file():
    raise InvalidArgument(f"{path} is not a Hugging Face checkpoint directory: no config.json")
  with open(file, encoding="utf-8") as f:
    return json.load(f)


def _int(hf: dict, key: str, default: Any = None) -> int:
  value = hf.get(key, default)
  if value is None and default is not None:
    value = default
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise InvalidArgument(f"config.json: {key} must be a positive int, got {value!r}")
  return value


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
  """`(rope_theta, scaling)` from the legacy fields or transformers 5's `rope_parameters`."""
  params = hf.get("rope_parameters")
  if isinstance(params, dict) and "rope_theta" in params:
    theta, scaling = params["rope_theta"], params
  else:
    theta, scaling = hf.get("rope_theta", 10000.0), hf.get("rope_scaling")
  if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
    raise InvalidArgument(f"config.json: rope_theta must be a number > 0, got {theta!r}")
  if scaling is None:
    return float(theta), None
  if not isinstance(scaling, dict):
    raise UnsupportedCheckpoint(f"config.json: rope_scaling must be an object, got {scaling!r}")
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return float(theta), None
  if kind not in SUPPORTED_ROPE_TYPES:
    raise UnsupportedCheckpoint(f"config.json: rope scaling type {kind!r} is not implemented "
                                f"(supported: default, {', '.join(SUPPORTED_ROPE_TYPES)})")
  if "factor" not in scaling:
    raise InvalidArgument(f"config.json: {kind} rope scaling without a factor: {scaling}")
  kwargs: dict[str, Any] = dict(rope_type=kind, factor=float(scaling["factor"]))
  if kind == "llama3":
    for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
      if key not in scaling:
        raise InvalidArgument(f"config.json: llama3 rope scaling without {key}: {scaling}")
    kwargs.update(low_freq_factor=float(scaling["low_freq_factor"]),
                  high_freq_factor=float(scaling["high_freq_factor"]),
                  original_max_position_embeddings=int(
                      scaling["original_max_position_embeddings"]))
  attention_factor = scaling.get("attention_factor")
  if attention_factor not in (None, 1, 1.0):
    raise UnsupportedCheckpoint(f"config.json: rope attention_factor {attention_factor} is "
                                f"not implemented (cos/sin are not rescaled)")
  return float(theta), RopeScaling(**kwargs)


def _sliding_window(hf: dict, model_type: str) -> int | None:
  """The sliding window the model attends within, or None (full attention)."""
  window = hf.get("sliding_window")
  if model_type == "qwen2" and not hf.get("use_sliding_window", False):
    return None
  if model_type == "llama":
    return None
  if window is None:
    return None
  if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
    raise InvalidArgument(f"config.json: sliding_window must be a positive int or null, got "
                          f"{window!r}")
  return window


def llama_config_from_hf(hf: dict, *, dtype: str | None = None,
                         max_seq_len: int | None = None) -> tuple[Any, int]:
  """Maps a `config.json` dict onto `(LlamaConfig, max_seq_len)`.

  `dtype` and `max_seq_len` as in `load_checkpoint`. Raises
  `UnsupportedCheckpoint` (a field the model does not compute) or
  `InvalidArgument` (a required field missing or malformed).
  """
  from paged_kv.model.llama import LlamaConfig  # pylint: disable=import-outside-toplevel
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise UnsupportedCheckpoint(f"config.json: model_type {model_type!r} is not supported "
                                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise UnsupportedCheckpoint(f"config.json: hidden_act {act!r} is not implemented (the "
                                f"MLP is SwiGLU: silu)")
  if hf.get("mlp_bias", False):
    raise UnsupportedCheckpoint("config.json: mlp_bias=true is not implemented (the MLP "
                                "projections are bias-free)")
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise UnsupportedCheckpoint(f"config.json: partial_rotary_factor="
                                f"{hf['partial_rotary_factor']} is not implemented (RoPE "
                                f"rotates the whole head)")
  if hf.get("quantization_config") is not None:
    raise UnsupportedCheckpoint("config.json: quantized checkpoints (quantization_config) "
                                "are not supported; use bf16, f16 or f32 weights")
  for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size"):
    if key not in hf:
      raise InvalidArgument(f"config.json: missing {key}")
  heads = _int(hf, "num_attention_heads")
  d_model = _int(hf, "hidden_size")
  head_dim = hf.get("head_dim")
  if head_dim is None:
    if d_model % heads:
      raise InvalidArgument(f"config.json: hidden_size={d_model} is not a multiple of "
                            f"num_attention_heads={heads} and no head_dim is given")
    head_dim = d_model // heads
  if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
    raise InvalidArgument(f"config.json: head_dim must be a positive int, got {head_dim!r}")
  theta, scaling = _rope(hf)
  if dtype is None:
    dtype = hf.get("torch_dtype", hf.get("dtype")) or "float32"
  if dtype not in _DTYPES:
    raise UnsupportedCheckpoint(f"dtype {dtype!r} is not supported (bfloat16, float16, "
                                f"float32)")
  max_pos = hf.get("max_position_embeddings")
  if max_seq_len is None:
    if max_pos is None:
      raise InvalidArgument("config.json has no max_position_embeddings: pass max_seq_len")
    max_seq_len = _int(hf, "max_position_embeddings")
  elif isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0:
    raise InvalidArgument(f"max_seq_len must be a positive int, got {max_seq_len!r}")
  window = _sliding_window(hf, model_type)
  if window is not None and max_seq_len > window:
    raise UnsupportedCheckpoint(
        f"config.json: sliding_window={window} ({model_type}): paged_kv attends to the "
        f"whole context, so sequences longer than the window would not compute what the "
        f"model computes; load with max_seq_len <= {window} (now {max_seq_len}) to serve "
        f"only sequences that fit it")
  bias = bool(hf.get("attention_bias", False))
  fields = dict(
      vocab_size=_int(hf, "vocab_size"), d_model=d_model,
      num_layers=_int(hf, "num_hidden_layers"), num_q_heads=heads,
      num_kv_heads=_int(hf, "num_key_value_heads", heads), head_dim=head_dim,
      ffn_dim=_int(hf, "intermediate_size"), rope_theta=theta,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=_DTYPES[dtype],
      rope_scaling=scaling, attention_bias=model_type == "qwen2" or bias,
      attention_out_bias=model_type == "llama" and bias)
  try:
    return LlamaConfig(**fields), max_seq_len
  except ValueError as err:  # e.g. heads not a multiple of the kv heads
    if isinstance(err, InvalidArgument):
      raise
    raise InvalidArgument(f"config.json: {err}") from err


def tensor_names(config) -> dict[tuple, tuple[str, bool]]:
  """Every parameter path of `TinyLlama(config)` (unrolled) -> `(tensor name, transposed)`."""
  names: dict[tuple, tuple[str, bool]] = {("embed", "embedding"): ("model.embed_tokens.weight",
                                                                   False),
                                          ("final_norm", "weight"): ("model.norm.weight", False)}
  if not config.tie_embeddings:
    names[("lm_head", "kernel")] = ("lm_head.weight", True)
  for i in range(config.num_layers):
    hf, ours = f"model.layers.{i}", ("layers", i)
    names[ours + ("attn_norm", "weight")] = (f"{hf}.input_layernorm.weight", False)
    names[ours + ("mlp_norm", "weight")] = (f"{hf}.post_attention_layernorm.weight", False)
    for p in ("q", "k", "v", "o"):
      names[ours + ("attn", f"w{p}", "kernel")] = (f"{hf}.self_attn.{p}_proj.weight", True)
      if (config.attention_out_bias if p == "o" else config.attention_bias):
        names[ours + ("attn", f"w{p}", "bias")] = (f"{hf}.self_attn.{p}_proj.bias", False)
    for p in ("gate", "up", "down"):
      names[ours + ("mlp", p, "kernel")] = (f"{hf}.mlp.{p}_proj.weight", True)
  return names


def _ignored(name: str, config) -> bool:
  return name.endswith(".rotary_emb.inv_freq") or (config.tie_embeddings
                                                   and name == "lm_head.weight")


def _tensor_files(path: Path) -> dict[str, Path]:
  """Tensor name -> the safetensors file holding it (sharded or not)."""
  st = _safetensors()
  index = path / "model.safetensors.index.json"
  if index.is_file():
    with open(index, encoding="utf-8") as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointMismatch(f"{index} has no weight_map")
    files = {name: path / file for name, file in weight_map.items()}
    absent = sorted({str(p.name) for p in files.values() if not p.is_file()})
    if absent:
      raise CheckpointMismatch(f"{index} lists shards that are not in {path}: {_listed(absent)}")
    return files
  shards = sorted(path.glob("*.safetensors"))
  if not shards:
    bins = sorted(p.name for p in path.glob("*.bin"))
    raise CheckpointMismatch(f"no *.safetensors in {path}" + (
        f" ({_listed(bins)} are PyTorch pickles, which paged_kv does not read: save the "
        f"model with safe_serialization=True)" if bins else ""))
  files: dict[str, Path] = {}
  for shard in shards:
    with st.safe_open(str(shard), framework="numpy") as f:
      for name in f.keys():
        if name in files:
          raise CheckpointMismatch(f"tensor {name} is in both {files[name].name} and "
                                   f"{shard.name}")
        files[name] = shard
  return files


def _expected_shape(path: tuple, config) -> tuple[int, ...]:
  """The Hugging Face (`[out, in]`) shape of the tensor of our parameter `path`."""
  c = config
  q, kv = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
  leaf = path[-2:]
  shapes = {
      ("embed", "embedding"): (c.vocab_size, c.d_model),
      ("lm_head", "kernel"): (c.vocab_size, c.d_model),
      ("wq", "kernel"): (q, c.d_model), ("wk", "kernel"): (kv, c.d_model),
      ("wv", "kernel"): (kv, c.d_model), ("wo", "kernel"): (c.d_model, q),
      ("wq", "bias"): (q,), ("wk", "bias"): (kv,), ("wv", "bias"): (kv,),
      ("wo", "bias"): (c.d_model,),
      ("gate", "kernel"): (c.ffn_dim, c.d_model), ("up", "kernel"): (c.ffn_dim, c.d_model),
      ("down", "kernel"): (c.d_model, c.ffn_dim),
  }
  return shapes.get(leaf, (c.d_model,))  # the norms' weights


def _model_path(path: tuple, scan_layers: bool) -> tuple:
  """The model's parameter holding `tensor_names`' (unrolled) `path`."""
  return ("layers",) + path[2:] if scan_layers and path[0] == "layers" else path


def load_checkpoint(path: str | os.PathLike, *, dtype: str | None = None,
                    max_seq_len: int | None = None, scan_layers: bool = True) -> HFCheckpoint:
  """Loads a Hugging Face Llama/Mistral/Qwen2 checkpoint directory: an `HFCheckpoint`.

  `dtype` None: the config's; `max_seq_len` None: `max_position_embeddings`
  (must fit a sliding window); `scan_layers` picks the layout.

  Raises:
    UnsupportedCheckpoint: the config asks for what the model does not compute.
    CheckpointMismatch: tensors missing, unexpected, misshapen, or not bf16/f16/f32.
    InvalidArgument: not a checkpoint directory, or a malformed config.
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from paged_kv.model.llama import TinyLlama  # pylint: disable=import-outside-toplevel
  from paged_kv.model.nnx_import import nnx  # pylint: disable=import-outside-toplevel
  st = _safetensors()
  path = Path(path)
  hf = read_hf_config(path)
  if not isinstance(scan_layers, bool):
    raise InvalidArgument(f"scan_layers must be a bool, got {scan_layers!r}")
  config, max_seq_len = llama_config_from_hf(hf, dtype=dtype, max_seq_len=max_seq_len)
  config = dataclasses.replace(config, scan_layers=scan_layers)
  names = tensor_names(config)
  files = _tensor_files(path)
  wanted = {name for name, _ in names.values()}
  missing = wanted - files.keys()
  if missing:
    raise CheckpointMismatch(f"{path}: missing tensors for the config's model "
                             f"({hf.get('model_type')}, {config.num_layers} layers"
                             f"{', tied embeddings' if config.tie_embeddings else ''}"
                             f"{', q/k/v biases' if config.attention_bias else ''}): "
                             f"{_listed(missing)}")
  unexpected = {n for n in files if n not in wanted and not _ignored(n, config)}
  if unexpected:
    raise CheckpointMismatch(f"{path}: tensors the config's model has no place for "
                             f"(another architecture, a bias or a layer it does not have?): "
                             f"{_listed(unexpected)}")
  abstract = nnx.eval_shape(lambda: TinyLlama(config, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  flat = list(nnx.to_flat_state(state))
  sources: dict[tuple, list[tuple]] = {}  # model parameter -> its tensors' paths, layer order
  for p in sorted(names, key=lambda p: p[1] if p[0] == "layers" else -1):
    sources.setdefault(_model_path(p, scan_layers), []).append(p)
  if {p for p, _ in flat} != sources.keys():  # a bug here, not the user's
    raise AssertionError(f"tensor_names out of date: "
                         f"{sorted(map(str, {p for p, _ in flat} ^ sources.keys()))}")
  target = jnp.dtype(config.dtype)
  arrays: dict[tuple, Any] = {}
  with contextlib.ExitStack() as stack:
    opened: dict[Path, Any] = {}

    def read(p: tuple) -> Any:
      """Tensor of `p` on the host, checked, as `[in, out]` (a transposed view)."""
      name, transposed = names[p]
      file = files[name]
      if file not in opened:
        opened[file] = stack.enter_context(st.safe_open(str(file), framework="numpy"))
      view = opened[file].get_slice(name)
      if view.get_dtype() not in _TENSOR_DTYPES:
        raise CheckpointMismatch(f"{name} in {file.name} is {view.get_dtype()}; paged_kv "
                                 f"reads {', '.join(_TENSOR_DTYPES)} tensors")
      shape, want = tuple(view.get_shape()), _expected_shape(p, config)
      if shape != want:
        raise CheckpointMismatch(f"{name} in {file.name} has shape {list(shape)}; the "
                                 f"config implies {list(want)}")
      x = opened[file].get_tensor(name)
      return x.T if transposed else x

    for p, _ in flat:
      parts = sources[p]
      if p[0] == "layers" and scan_layers:  # stacked on the host, one layer at a time
        first = read(parts[0])
        host = np.empty((len(parts),) + first.shape, target)
        host[0] = first  # cast to `target` by the assignment
        for i, part in enumerate(parts[1:], 1):
          host[i] = read(part)
      else:
        host = read(parts[0]).astype(target)
      arrays[p] = jnp.asarray(host)  # one device array per parameter
  loaded = nnx.from_flat_state([(p, var.replace(arrays[p])) for p, var in flat])
  model = nnx.merge(graphdef, loaded)
  eos = hf.get("eos_token_id")
  eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
  bos = hf.get("bos_token_id")
  return HFCheckpoint(model=model, config=config, model_type=hf["model_type"],
                      max_seq_len=max_seq_len, bos_token_id=None if bos is None else int(bos),
                      eos_token_ids=eos_ids, path=path)

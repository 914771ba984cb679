"""Hugging Face checkpoints (issue O item 5): a tiny random checkpoint in the layout of
each family (Llama with llama3 RoPE scaling, Mistral-style with its own head_dim, Qwen2
with q/k/v biases, tied embeddings, linear scaling, shards) loads into `TinyLlama`; one
layer's output and the full logits equal a plain-numpy re-implementation of the
transformers formulas written here (it imports nothing of paged_kv's model); the loaded
model served by `Scheduler` + `ModelExecutor` generates what `dense_forward` does; and
what the reference model cannot compute is refused, by name."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="the hf extra (pip install 'paged-kv[hf]')")

# pylint: disable=wrong-import-position
import jax.numpy as jnp

import paged_kv
from paged_kv.model import hf_checkpoint, llama
from paged_kv.model.reference import generate_dense
from tests.model.hf_files import LLAMA, MISTRAL, QWEN2, head_dim, hf_weights, write_checkpoint
# pylint: enable=wrong-import-position

FAMILIES = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2}


# --- the reference: transformers' Llama-family formulas, in float64 numpy ---------------

def ref_inv_freq(hf: dict) -> np.ndarray:
  """`_compute_default_rope_parameters`, then the linear / llama3 scaling."""
  d = head_dim(hf)
  base = hf.get("rope_theta", 10000.0)
  inv_freq = 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))
  rs = hf.get("rope_scaling") or {}
  kind = rs.get("rope_type", rs.get("type", "default"))
  if kind == "linear":
    return inv_freq / rs["factor"]
  if kind == "llama3":
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for f in inv_freq:
      wavelen = 2 * math.pi / f
      if wavelen < high_wavelen:
        out.append(f)
      elif wavelen > low_wavelen:
        out.append(f / factor)
      else:
        smooth = (old / wavelen - low) / (high - low)
        out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)
  return inv_freq


def ref_rms_norm(x, weight, eps):
  return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rotate_half(x):
  half = x.shape[-1] // 2
  return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def ref_layer(w: dict, hf: dict, layer: int, x: np.ndarray) -> np.ndarray:
  """`LlamaDecoderLayer.forward` for one sequence `x [T, hidden]` at positions 0..T-1."""
  p = f"model.layers.{layer}"
  t = x.shape[0]
  d, hq, hkv = head_dim(hf), hf["num_attention_heads"], hf["num_key_value_heads"]
  eps = hf["rms_norm_eps"]
  lin = lambda h, name: h @ w[f"{p}.{name}.weight"].T + w.get(f"{p}.{name}.bias", 0.0)
  h = ref_rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
  q = lin(h, "self_attn.q_proj").reshape(t, hq, d).transpose(1, 0, 2)   # [H, T, D]
  k = lin(h, "self_attn.k_proj").reshape(t, hkv, d).transpose(1, 0, 2)
  v = lin(h, "self_attn.v_proj").reshape(t, hkv, d).transpose(1, 0, 2)
  freqs = np.arange(t, dtype=np.float64)[:, None] * ref_inv_freq(hf)[None, :]
  emb = np.concatenate([freqs, freqs], axis=-1)                          # [T, D]
  cos, sin = np.cos(emb), np.sin(emb)
  q = q * cos + rotate_half(q) * sin
  k = k * cos + rotate_half(k) * sin
  k = np.repeat(k, hq // hkv, axis=0)                                   # repeat_kv
  v = np.repeat(v, hq // hkv, axis=0)
  scores = q @ k.transpose(0, 2, 1) / math.sqrt(d)
  scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  o = (probs @ v).transpose(1, 0, 2).reshape(t, hq * d)
  x = x + lin(o, "self_attn.o_proj")
  h = ref_rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
  gate, up = lin(h, "mlp.gate_proj"), lin(h, "mlp.up_proj")
  return x + lin(gate / (1 + np.exp(-gate)) * up, "mlp.down_proj")


def ref_logits(w: dict, hf: dict, tokens) -> np.ndarray:
  """`LlamaForCausalLM.forward` logits `[T, vocab]` of one sequence."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  x = w["model.embed_tokens.weight"][np.asarray(tokens)]
  for layer in range(hf["num_hidden_layers"]):
    x = ref_layer(w, hf, layer, x)
  x = ref_rms_norm(x, w["model.norm.weight"], hf["rms_norm_eps"])
  head = w["model.embed_tokens.weight"] if hf.get("tie_word_embeddings") else w["lm_head.weight"]
  return x @ head.T


# --- loading ------------------------------------------------------------------------------

@pytest.fixture(scope="module", name="checkpoints")
def _checkpoints(tmp_path_factory):
  """Each family written once: `{name: (dir, config, weights as stored)}`."""
  out = {}
  for name, hf in FAMILIES.items():
    path = tmp_path_factory.mktemp(name)
    weights = write_checkpoint(path, hf, seed=len(out), shards=2 if name == "qwen2" else 1)
    out[name] = (path, hf, weights)
  return out


def test_rope_scaling_reference_bands():
  """The llama3 reference itself: high frequencies kept, low ones divided by the factor,
  the band between strictly between (so the formula the tests hold us to is sane)."""
  inv = ref_inv_freq(LLAMA)
  plain = ref_inv_freq(dict(LLAMA, rope_scaling=None))
  wavelen = 2 * np.pi / plain
  high = wavelen < 256 / 4
  low = wavelen > 256 / 1
  assert high.any() and low.any() and (~high & ~low).any()
  np.testing.assert_allclose(inv[high], plain[high])
  np.testing.assert_allclose(inv[low], plain[low] / 8)
  mid = ~high & ~low
  assert ((inv[mid] < plain[mid]) & (inv[mid] > plain[mid] / 8)).all()
  from paged_kv.model import rope  # pylint: disable=import-outside-toplevel
  cfg = hf_checkpoint.llama_config_from_hf(LLAMA)[0]
  ours = rope.inverse_frequencies(16, theta=cfg.rope_theta, scaling=cfg.rope_scaling)
  np.testing.assert_allclose(ours, inv, rtol=1e-6)


LAYOUTS = {"scanned": True, "unrolled": False}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_layer_and_logits_match_the_transformers_formulas(checkpoints, name, layout):
  path, hf, weights = checkpoints[name]
  ckpt = hf_checkpoint.load_checkpoint(path, dtype="float32", scan_layers=LAYOUTS[layout])
  assert ckpt.model_type == name and ckpt.config.dtype == "float32"
  assert ckpt.config.scan_layers == LAYOUTS[layout]
  assert ckpt.eos_token_ids == (2,)
  model = ckpt.model
  rng = np.random.default_rng(7)
  t = 24
  tokens = rng.integers(0, hf["vocab_size"], t)
  # One layer: our DecoderBlock on the embedded tokens against the reference layer.
  w64 = {k: v.astype(np.float64) for k, v in weights.items()}
  x = w64["model.embed_tokens.weight"][tokens]
  positions = jnp.arange(t, dtype=jnp.int32)[None]
  ours = model.block(0).dense(jnp.asarray(x[None], jnp.float32), positions,
                              jnp.ones((1, t), bool))
  np.testing.assert_allclose(np.asarray(ours[0]), ref_layer(w64, hf, 0, x), rtol=2e-4,
                             atol=2e-4)
  # The whole model.
  want = ref_logits(weights, hf, tokens)
  got = np.asarray(llama.dense_forward(model, jnp.asarray(tokens[None], jnp.int32),
                                       jnp.asarray([t], jnp.int32)))[0]
  np.testing.assert_allclose(got, want, rtol=5e-4, atol=5e-4)
  # Teeth: without the config's RoPE scaling the logits are measurably different.
  if hf.get("rope_scaling"):
    unscaled = ref_logits(weights, dict(hf, rope_scaling=None), tokens)
    assert np.max(np.abs(unscaled - want)) > 1e-2


def test_loads_in_the_checkpoint_dtype(checkpoints):
  path, hf, weights = checkpoints["mistral"]  # stored bf16, config torch_dtype bfloat16
  ckpt = hf_checkpoint.load_checkpoint(path)
  assert ckpt.config.dtype == "bfloat16" and ckpt.config.head_dim == 24
  stacked = ckpt.model.layers.attn.wk.kernel.get_value()  # scanned by default
  assert stacked.dtype == jnp.bfloat16 and stacked.shape == (2, 64, 24)  # [L, in, out]
  for layer in range(2):
    np.testing.assert_array_equal(np.asarray(stacked[layer], np.float32),
                                  weights[f"model.layers.{layer}.self_attn.k_proj.weight"].T)
  unrolled = hf_checkpoint.load_checkpoint(path, scan_layers=False)
  kernel = unrolled.model.layers[1].attn.wk.kernel.get_value()
  assert kernel.dtype == jnp.bfloat16 and kernel.shape == (64, 24)  # [in, out]: transposed
  np.testing.assert_array_equal(np.asarray(kernel, np.float32),
                                weights["model.layers.1.self_attn.k_proj.weight"].T)
  tied = hf_checkpoint.load_checkpoint(checkpoints["qwen2"][0])
  assert tied.config.dtype == "float16" and tied.model.lm_head is None
  assert tied.config.attention_bias and not tied.config.attention_out_bias
  assert tied.bos_token_id is None


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_served_greedy_equals_dense(checkpoints, name, layout):
  """The loaded model through Scheduler + ModelExecutor (paged, logits_indices) generates
  what llama.dense_forward does, token for token, in either layer layout."""
  # pylint: disable=import-outside-toplevel
  from paged_kv.scheduler.executor import ModelExecutor
  from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig
  path, hf, _ = checkpoints[name]
  ckpt = hf_checkpoint.load_checkpoint(path, dtype="float32", max_seq_len=64,
                                       scan_layers=LAYOUTS[layout])
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, hf["vocab_size"], n).tolist() for n in (11, 5, 17)]
  new_tokens = 6
  want = generate_dense(ckpt.model, prompts, new_tokens)
  pool_config = llama.pool_config_for(ckpt.config, num_blocks=32, block_size=4, max_seqs=4,
                                      max_segments=16)
  executor = ModelExecutor(ckpt.model, pool_config)
  assert executor.uses_logits_indices
  sched = Scheduler(paged_kv.BlockPool(pool_config), executor,
                    SchedulerConfig(max_batch=4, prefill_chunk=8, prefill_token_budget=16))
  reqs = [Request(i, p, new_tokens) for i, p in enumerate(prompts)]
  for r in reqs:
    sched.submit(r)
  for _ in range(100):
    if sched.idle:
      break
    sched.step()
  assert sched.idle
  for r, w in zip(reqs, want):
    assert list(r.prompt) + list(r.output) == w


def test_stacked_weights_go_to_the_device_once(checkpoints, monkeypatch):
  """Scanned layout: each stacked weight is built on the host and moved in one transfer
  of its `[num_layers, ...]` shape (no per-layer device arrays stacked on the device),
  with every layer's tensor in its place."""
  path, hf, weights = checkpoints["qwen2"]  # 3 layers, q/k/v biases, tied, 2 shards
  sent = []
  real = jnp.asarray

  def spy(x, *args, **kwargs):
    if isinstance(x, np.ndarray):
      sent.append(x.shape)
    return real(x, *args, **kwargs)

  monkeypatch.setattr(jnp, "asarray", spy)
  ckpt = hf_checkpoint.load_checkpoint(path, dtype="float32")
  monkeypatch.undo()
  from paged_kv.model.nnx_import import nnx  # pylint: disable=import-outside-toplevel
  params = dict(nnx.to_flat_state(nnx.state(ckpt.model)))
  assert sorted(sent) == sorted(v.get_value().shape for v in params.values())
  layers = hf["num_hidden_layers"]
  stacked = {p: v.get_value() for p, v in params.items() if p[0] == "layers"}
  assert len(stacked) == 12 and all(a.shape[0] == layers for a in stacked.values())
  np.testing.assert_array_equal(np.asarray(stacked[("layers", "attn", "wq", "bias")]),
                                np.stack([weights[f"model.layers.{i}.self_attn.q_proj.bias"]
                                          for i in range(layers)]).astype(np.float32))
  np.testing.assert_array_equal(np.asarray(stacked[("layers", "mlp", "down", "kernel")][2]),
                                weights["model.layers.2.mlp.down_proj.weight"].T)


# --- what is refused ----------------------------------------------------------------------

def _write(tmp_path, hf, **kwargs):
  write_checkpoint(tmp_path, hf, **kwargs)
  return tmp_path


@pytest.mark.parametrize("change, pattern", [
    (dict(model_type="gemma"), r"model_type 'gemma' is not supported"),
    (dict(hidden_act="gelu"), r"hidden_act 'gelu' is not implemented"),
    (dict(mlp_bias=True), r"mlp_bias=true is not implemented"),
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0.5"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), r"rope scaling type 'yarn'"),
    (dict(rope_scaling=dict(type="dynamic", factor=2.0)), r"rope scaling type 'dynamic'"),
    (dict(quantization_config=dict(quant_method="gptq")), r"quantized checkpoints"),
])
def test_unsupported_config_fields_raise(change, pattern):
  with pytest.raises(hf_checkpoint.UnsupportedCheckpoint, match=pattern):
    hf_checkpoint.llama_config_from_hf(dict(LLAMA, **change))


def test_transformers5_rope_parameters():
  hf = {k: v for k, v in LLAMA.items() if k not in ("rope_theta", "rope_scaling")}
  hf["rope_parameters"] = dict(LLAMA["rope_scaling"], rope_theta=500000.0)
  config, _ = hf_checkpoint.llama_config_from_hf(hf)
  assert config.rope_theta == 500000.0 and config.rope_scaling.rope_type == "llama3"
  assert hf_checkpoint.llama_config_from_hf(
      dict(hf, rope_parameters=dict(rope_type="default", rope_theta=1e4)))[0].rope_scaling is None


def test_sliding_window_needs_a_max_seq_len_inside_it():
  hf = dict(MISTRAL, sliding_window=32)
  with pytest.raises(hf_checkpoint.UnsupportedCheckpoint,
                     match=r"sliding_window=32 .*max_seq_len <= 32 \(now 4096\)"):
    hf_checkpoint.llama_config_from_hf(hf)
  assert hf_checkpoint.llama_config_from_hf(hf, max_seq_len=32)[1] == 32
  # Qwen2's window is off unless use_sliding_window says so.
  assert hf_checkpoint.llama_config_from_hf(QWEN2)[1] == 1024
  with pytest.raises(hf_checkpoint.UnsupportedCheckpoint, match="sliding_window=4096"):
    hf_checkpoint.llama_config_from_hf(dict(QWEN2, use_sliding_window=True,
                                            max_position_embeddings=32768))


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path):
  w = hf_weights(LLAMA, seed=0)
  del w["model.layers.1.self_attn.k_proj.weight"]
  with pytest.raises(hf_checkpoint.CheckpointMismatch,
                     match=r"missing tensors.*model.layers.1.self_attn.k_proj.weight"):
    hf_checkpoint.load_checkpoint(_write(tmp_path / "a", LLAMA, weights=w))
  w = hf_weights(LLAMA, seed=0)
  w["model.layers.0.mlp.gate_proj.bias"] = np.zeros(96, np.float32)
  with pytest.raises(hf_checkpoint.CheckpointMismatch,
                     match=r"no place for.*model.layers.0.mlp.gate_proj.bias"):
    hf_checkpoint.load_checkpoint(_write(tmp_path / "b", LLAMA, weights=w))
  w = hf_weights(LLAMA, seed=0)
  w["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
  with pytest.raises(hf_checkpoint.CheckpointMismatch,
                     match=r"k_proj.weight in model.safetensors has shape \[64, 64\]; the "
                           r"config implies \[32, 64\]"):
    hf_checkpoint.load_checkpoint(_write(tmp_path / "c", LLAMA, weights=w))
  w = hf_weights(LLAMA, seed=0)
  w["model.norm.weight"] = np.zeros(64, np.int8)
  with pytest.raises(hf_checkpoint.CheckpointMismatch, match=r"model.norm.weight .* is I8"):
    hf_checkpoint.load_checkpoint(_write(tmp_path / "d", LLAMA, weights=w))


def test_ignored_tensors_and_other_directories(tmp_path):
  # Old checkpoints' rotary buffers and a tied checkpoint's lm_head are not errors.
  w = hf_weights(QWEN2, seed=0)
  w["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
  w["lm_head.weight"] = w["model.embed_tokens.weight"].copy()
  hf_checkpoint.load_checkpoint(_write(tmp_path / "a", QWEN2, weights=w))
  with pytest.raises(paged_kv.InvalidArgument, match="no config.json"):
    hf_checkpoint.load_checkpoint(tmp_path)
  (tmp_path / "b").mkdir()
  (tmp_path / "b" / "config.json").write_text(json.dumps(LLAMA))
  (tmp_path / "b" / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(hf_checkpoint.CheckpointMismatch,
                     match=r"no \*.safetensors.*pytorch_model.bin are PyTorch pickles"):
    hf_checkpoint.load_checkpoint(tmp_path / "b")


def test_core_imports_without_the_extras():
  """paged_kv and paged_kv.model import without safetensors/tokenizers; the loader names
  the extra when they are missing (run in a child with both blocked)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  code = """
import sys
class Block:
  def find_spec(self, name, path=None, target=None):
    if name.split('.')[0] in ('safetensors', 'tokenizers'):
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
import paged_kv, paged_kv.model, paged_kv.scheduler, paged_kv.cache
from paged_kv.model import hf_checkpoint, tokenizer
for call in (lambda: hf_checkpoint.load_checkpoint(sys.argv[1]),
             lambda: tokenizer.Tokenizer.from_file(sys.argv[1] + '/config.json')):
  try:
    call()
  except ModuleNotFoundError as err:
    print(err)
"""
  import tempfile  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory() as d:
    with open(f"{d}/config.json", "w", encoding="utf-8") as f:
      json.dump(LLAMA, f)
    proc = subprocess.run([sys.executable, "-c", code, d], capture_output=True, text=True,
                          timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
                                            "PYTHONPATH": str(__import__("pathlib").Path(
                                                __file__).resolve().parents[2])})
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.count("pip install 'paged-kv[hf]'") == 2, proc.stdout

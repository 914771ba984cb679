"""Trains the tiny Llama briefly (about a minute on CPU) on text the script generates itself.

The corpus is byte-level English from a small seeded grammar (sentences about
blocks, pools and caches, plus counting lines), so no download is needed. The
model trains through the dense path (`TinyLlama.dense`, no cache) with optax AdamW,
then generates greedily through the paged pool (`paged_kv.model.runner.generate_paged`)
and checks the output equals the dense reference before saving the weights.

The equivalence tests do not need trained weights (they use seeded random ones);
a trained model only makes the demo's text readable.

Usage:
  python examples/train_tiny.py [--steps=300 --out=/tmp/llama.npz]
"""

from __future__ import annotations

import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from paged_kv.model import llama
from paged_kv.model.reference import generate_dense
from paged_kv.model.runner import generate_paged
from paged_kv.runtime import compile_cache

_STEPS = flags.DEFINE_integer("steps", 300, "Optimizer steps.")
_BATCH = flags.DEFINE_integer("batch", 32, "Sequences per step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Bytes per training sequence.")
_LR = flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW learning rate.")
_SEED = flags.DEFINE_integer("seed", 0, "Weights, data and batch order seed.")
_OUT = flags.DEFINE_string("out", "", "Where to save the weights (.npz); empty = don't.")
_COMPILE_CACHE = flags.DEFINE_bool("compile_cache", True, "Use JAX's persistent compilation "
                                   "cache (restarts skip XLA compiles).")
_COMPILE_CACHE_DIR = flags.DEFINE_string("compile_cache_dir", None, "The cache's directory "
                                         "(default: $PAGED_KV_COMPILE_CACHE, else "
                                         "~/.cache/paged_kv/jax).")

_SUBJECTS = ["the pool", "a block", "the cache", "every sequence", "the scheduler", "a segment"]
_VERBS = ["holds", "frees", "shares", "moves", "packs", "reads"]
_OBJECTS = ["the prefix", "sixteen tokens", "a free block", "the tail", "its pages", "the tree"]


def make_corpus(num_lines: int, seed: int) -> bytes:
  """Seeded synthetic text: simple sentences and counting lines, one per line."""
  rng = np.random.default_rng(seed)
  lines = []
  for _ in range(num_lines):
    if rng.random() < 0.25:
      start = int(rng.integers(0, 50))
      lines.append(" ".join(str(start + i) for i in range(6)) + ".")
    else:
      s, v, o = (x[int(rng.integers(len(x)))] for x in (_SUBJECTS, _VERBS, _OBJECTS))
      lines.append(f"{s} {v} {o}.")
  return ("\n".join(lines) + "\n").encode()


def save_params(model: llama.TinyLlama, path: str) -> None:
  """Saves the model's parameters as an .npz keyed by their paths."""
  flat = {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model))}
  np.savez(path, **flat)


def load_params(model: llama.TinyLlama, path: str) -> None:
  """Loads parameters saved by `save_params` into `model` (same config)."""
  data = np.load(path)
  state = nnx.state(model)
  flat = nnx.to_flat_state(state)
  for key, var in flat:
    name = "/".join(map(str, key))
    if name not in data or data[name].shape != var.shape:
      raise ValueError(f"{path}: missing or mis-shaped parameter {name}")
    var[...] = jnp.asarray(data[name])
  nnx.update(model, nnx.from_flat_state(flat))


def main(argv):
  del argv
  if _COMPILE_CACHE.value:
    compile_cache.enable_compilation_cache(_COMPILE_CACHE_DIR.value)
  config = llama.LlamaConfig()
  model = llama.TinyLlama(config, rngs=nnx.Rngs(_SEED.value))
  corpus = np.frombuffer(make_corpus(4000, _SEED.value), np.uint8).astype(np.int32)
  graphdef, params = nnx.split(model)
  warmup = max(1, min(20, _STEPS.value // 10))
  schedule = optax.warmup_cosine_decay_schedule(0.0, _LR.value, warmup,
                                                 max(_STEPS.value, warmup + 1))
  tx = optax.adamw(schedule, weight_decay=0.01)
  opt_state = tx.init(params)
  t = _SEQ_LEN.value

  def loss_fn(p, batch):
    m = nnx.merge(graphdef, p)
    tokens = batch[:, :-1]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
    logits = m.dense(tokens, positions, positions < t)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

  @jax.jit
  def train_step(p, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(p, batch)
    updates, opt_state = tx.update(grads, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, loss

  rng = np.random.default_rng(_SEED.value)
  start = time.perf_counter()
  for step in range(_STEPS.value):
    offsets = rng.integers(0, corpus.size - t - 1, _BATCH.value)
    batch = np.stack([corpus[o:o + t + 1] for o in offsets])
    params, opt_state, loss = train_step(params, opt_state, batch)
    if step % 50 == 0 or step == _STEPS.value - 1:
      print(f"step {step:4d}  loss {float(loss):.3f}  ({time.perf_counter() - start:.0f} s)")
  nnx.update(model, params)

  prompts = [list(b"the pool "), list(b"12 13 14"), list(b"a segment sh")]
  pool_config = llama.pool_config_for(config, num_blocks=64, block_size=16, max_seqs=4,
                                   max_segments=8)
  runner = generate_paged(model, prompts, 40, pool_config=pool_config, prefill_chunk=16)
  dense = generate_dense(model, prompts, 40)
  for i, prompt in enumerate(prompts):
    text = bytes(runner.records[i].tokens).decode(errors="replace")
    print(f"{bytes(prompt).decode()!r} -> {text!r}")
    if runner.records[i].tokens != dense[i]:
      raise AssertionError(f"paged and dense generation differ for prompt {i}")
  print("paged greedy generation equals the dense reference")
  if _OUT.value:
    save_params(model, _OUT.value)
    print(f"saved {_OUT.value}")


if __name__ == "__main__":
  app.run(main)

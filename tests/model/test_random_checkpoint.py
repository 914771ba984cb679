"""`paged_kv.model.random_checkpoint`: random checkpoints with real models' shapes.

The shapes' parameter counts are the published ones; a tiny checkpoint loads with
`hf_checkpoint.load_checkpoint`, its logits equal the numpy re-implementation of
transformers' formulas over the tensors as written (so the names and `[out, in]`
layouts are transformers'), and served through `Scheduler` + `ModelExecutor` it
generates the dense reference's greedy tokens, which depend on the context (not a
repeat of the last prompt token). Shards and bf16 store the same values. With
torch and transformers installed, transformers loads it and generates the same tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="the hf extra (pip install 'paged-kv[hf]')")

# pylint: disable=wrong-import-position
import ml_dtypes
from safetensors.numpy import load_file

from paged_kv.model import hf_checkpoint, hf_reference, random_checkpoint, reference
from paged_kv.model import llama
from paged_kv.sim import serving_bench as sb
from paged_kv.sim import workload
from paged_kv.scheduler.executor import ModelExecutor
from paged_kv.scheduler.scheduler import SchedulerConfig
from tests.model.test_hf_checkpoint import ref_logits
# pylint: enable=wrong-import-position


def test_shapes_have_the_published_sizes():
  count = lambda s: random_checkpoint.num_parameters(random_checkpoint.hf_config(s))
  assert count("llama-3.2-1b") == 1_235_814_400
  assert count("llama-3.1-8b") == 8_030_261_248
  one_b = random_checkpoint.hf_config("llama-3.2-1b")
  config, _ = hf_checkpoint.llama_config_from_hf(one_b, max_seq_len=4096)
  assert (config.num_layers, config.d_model, config.num_q_heads, config.num_kv_heads,
          config.head_dim, config.ffn_dim, config.vocab_size, config.tie_embeddings,
          config.dtype) == (16, 2048, 32, 8, 64, 8192, 128256, True, "bfloat16")
  assert config.rope_scaling.rope_type == "llama3" and config.rope_theta == 500000.0
  eight_b, _ = hf_checkpoint.llama_config_from_hf(
      random_checkpoint.hf_config("llama-3.1-8b"), max_seq_len=4096)
  assert (eight_b.num_layers, eight_b.head_dim, eight_b.tie_embeddings) == (32, 128, False)
  with pytest.raises(ValueError, match="unknown shape"):
    random_checkpoint.hf_config("llama-70b")


@pytest.fixture(scope="module", name="tiny")
def _tiny(tmp_path_factory):
  path = tmp_path_factory.mktemp("tiny")
  hf = random_checkpoint.hf_config("tiny", dtype="float32")
  random_checkpoint.write_random_checkpoint(path, hf, seed=3)
  return path, hf


def test_tensors_are_transformers_and_load(tiny):
  path, hf = tiny
  weights = load_file(str(path / "model.safetensors"))
  assert {n: w.shape for n, w in weights.items()} == {
      n: shape for n, shape, _ in random_checkpoint.tensor_specs(hf)}
  assert json.loads((path / "config.json").read_text()) == hf
  h = hf["hidden_size"]
  embed = weights["model.embed_tokens.weight"]
  assert abs(embed.std() * np.sqrt(h) - 1) < 0.05  # N(0, 1) / sqrt(fan_in)
  assert abs(weights["model.norm.weight"].mean() - 1) < 0.05
  ckpt = hf_checkpoint.load_checkpoint(path, max_seq_len=64)
  tokens = np.random.default_rng(0).integers(3, hf["vocab_size"], 12)
  want = ref_logits(weights, hf, tokens)
  got = np.asarray(llama.dense_forward(ckpt.model, tokens[None].astype(np.int32),
                                       np.array([12], np.int32)))[0, :12]
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.slow
def test_served_tokens_equal_the_dense_reference_and_follow_the_context(tiny):
  path, hf = tiny
  wl = workload.random_workload(5, 12, 6, hf["vocab_size"], seed=5)
  ckpt = hf_checkpoint.load_checkpoint(path, max_seq_len=wl.max_seq_len)
  pool_config = sb.serving_pool_config(ckpt.config, max_batch=2, max_seq_len=wl.max_seq_len,
                                       block_size=4)
  sched = sb.build_scheduler(ModelExecutor(ckpt.model, pool_config), pool_config,
                             SchedulerConfig(max_batch=2, prefill_chunk=16,
                                             prefill_token_budget=16, compaction=None))
  res = sb.run_closed_loop(sched, wl, 2)
  want = reference.generate_dense(ckpt.model, [p.tolist() for p in wl.prompts], 6)
  assert [list(p) + o for p, o in zip(wl.prompts, res.outputs)] == want
  # Not a copy of the last prompt token (a unit-variance tied embedding gives that).
  assert sum(o != [int(p[-1])] * 6 for p, o in zip(wl.prompts, res.outputs)) >= 3
  assert res.output_tokens == 30 and len(res.ttft_s) == 5 and len(res.tpot_s) == 5


def test_shards_and_bf16_store_the_same_values(tmp_path):
  hf = random_checkpoint.hf_config("tiny", dtype="float32")
  one = random_checkpoint.write_random_checkpoint(tmp_path / "one", hf, seed=1)
  many = random_checkpoint.write_random_checkpoint(tmp_path / "many", hf, seed=1,
                                                   max_shard_bytes=40_000, threads=3)
  index = json.loads((many / "model.safetensors.index.json").read_text())
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
  whole = load_file(str(one / "model.safetensors"))
  parts = {}
  for f in files:
    parts.update(load_file(str(many / f)))
  assert parts.keys() == whole.keys()
  for name, w in whole.items():
    np.testing.assert_array_equal(parts[name], w)
  assert index["metadata"]["total_size"] == sum(w.nbytes for w in whole.values())
  # bf16: the float32 values rounded; rewriting into a folder drops the old files.
  random_checkpoint.write_random_checkpoint(
      many, random_checkpoint.hf_config("tiny", dtype="bfloat16"), seed=1)
  assert sorted(p.name for p in many.iterdir()) == ["config.json", "model.safetensors"]
  half = load_file(str(many / "model.safetensors"))
  for name, w in whole.items():
    assert half[name].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(half[name], w.astype(ml_dtypes.bfloat16))
  assert hf_checkpoint.load_checkpoint(many, max_seq_len=32).config.dtype == "bfloat16"


def test_transformers_loads_it_and_generates_the_same_tokens(tiny):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  path, hf = tiny
  wl = workload.random_workload(4, 9, 6, hf["vocab_size"], seed=2)
  ckpt = hf_checkpoint.load_checkpoint(path, max_seq_len=wl.max_seq_len)
  ours = [s[9:] for s in reference.generate_dense(ckpt.model,
                                                  [p.tolist() for p in wl.prompts], 6)]
  ref = hf_reference.Reference(path, device="cpu")
  theirs = ref.greedy(wl.prompts, wl.output_lens).outputs
  assert hf_reference.compare(ours, theirs) == (4, [])
  check = ref.check(wl.prompts, ours)
  assert check.tokens == 24 and check.off == []
  bad = [list(o) for o in ours]
  bad[1][2] = (bad[1][2] + 1) % hf["vocab_size"]
  assert (1, 2) in [(r, p) for r, p, _ in ref.check(wl.prompts, bad).off]


def test_compare_counts_full_matches_and_first_differences():
  assert hf_reference.compare([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 7], [6, 8]]) == (
      1, [(1, 1), (2, 1)])


def test_byte_level_tokenizer_round_trips_any_text_within_the_vocabulary(tmp_path):
  tokenizers = pytest.importorskip("tokenizers", reason="the hf extra (pip install "
                                   "'paged-kv[hf]')")
  path = random_checkpoint.write_byte_level_tokenizer(tmp_path, 300)
  tok = tokenizers.Tokenizer.from_file(str(path))
  text = "a paged kv cache: héllo ✓ 123"
  ids = tok.encode(text).ids
  assert ids and max(ids) < 300 and tok.decode(ids) == text
  assert [tok.token_to_id(s) for s in ("<unk>", "<s>", "</s>")] == [0, 1, 2]
  with pytest.raises(ValueError, match="vocab_size=100 is below"):
    random_checkpoint.write_byte_level_tokenizer(tmp_path, 100)

"""`paged_kv.LLM`: generate / stream / abort over a tiny random checkpoint, checked
against the dense reference; the pool-sizing rule; typed errors with nothing queued.
One LLM for the module (its programs compile once)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax", reason="the model extra (pip install 'paged-kv[model]')")
pytest.importorskip("safetensors", reason="the hf extra (pip install 'paged-kv[hf]')")
pytest.importorskip("tokenizers", reason="the hf extra (pip install 'paged-kv[hf]')")

# pylint: disable=wrong-import-position
import paged_kv
from paged_kv.core.errors import InvalidArgument
from paged_kv.entrypoints.llm import ContextLengthExceeded, LLM, pool_blocks
from paged_kv.scheduler.parallel_sampling import SampleId
from paged_kv.scheduler.sampling_params import SamplingParams
from tests.entrypoints.llm_files import MAX_POSITIONS, write_chat_checkpoint


# The facade, and the server on 127.0.0.1 (10-20 s each).
pytestmark = pytest.mark.slow


EOS = 2
PROMPTS = ["the quick brown fox", "paged attention keeps", [1, 40, 41, 42, 43]]


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
  return write_chat_checkpoint(tmp_path_factory.mktemp("llm") / "tiny-chat")


@pytest.fixture(scope="module")
def llm(ckpt_dir):
  return LLM(ckpt_dir, max_batch=4, num_blocks=64, block_size=8, prompt_logprobs=True)


@pytest.fixture(scope="module")
def dense(llm, ckpt_dir):
  """Greedy tokens of the dense reference per prompt, cut after the first EOS."""
  from paged_kv.model import hf_checkpoint  # pylint: disable=import-outside-toplevel
  from paged_kv.model.reference import generate_dense  # pylint: disable=import-outside-toplevel
  model = hf_checkpoint.load_checkpoint(ckpt_dir).model
  ids = [llm.engine.encode(p) for p in PROMPTS]
  want = []
  for p, seq in zip(ids, generate_dense(model, ids, 8)):
    out = seq[len(p):]
    want.append(out[:out.index(EOS) + 1] if EOS in out else out)
  return ids, want


def _idle(llm) -> None:
  """Nothing live, no block held by a sequence, the pool and cache consistent."""
  assert llm.engine.num_live == 0 and llm.scheduler.idle
  assert llm.scheduler.take_stats().used_blocks == 0
  llm.scheduler.cached_pool.check_invariants()


def test_exported_lazily():
  assert paged_kv.LLM is LLM and paged_kv.SamplingParams is SamplingParams
  assert "LLM" in paged_kv.__all__


def test_attention_impl_names_the_path(llm):
  assert llm.attention_impl == "xla"  # on a CPU


def test_generate_equals_the_dense_reference(llm, dense):
  ids, want = dense
  outs = llm.generate(PROMPTS, max_tokens=8)
  assert [o.token_ids for o in outs] == [tuple(w) for w in want]
  for out, p, w in zip(outs, ids, want):
    assert out.prompt_token_ids == tuple(p)
    assert out.text == llm.tokenizer.decode(w)
    assert out.finish_reason == ("stop" if w[-1] == EOS else "length")
    assert out.logprobs is None
  assert llm.engine.encode(PROMPTS[0]) == llm.tokenizer.encode(PROMPTS[0])  # BOS added
  _idle(llm)


def test_a_stop_string_ends_the_text_before_it(llm):
  base = llm.generate([PROMPTS[1]], SamplingParams(ignore_eos=True), max_tokens=8)[0]
  text = base.text
  stop = text[len(text) // 2:len(text) // 2 + 2]  # two characters from its middle
  assert stop.strip() and stop in text, text
  out = llm.generate([PROMPTS[1]], SamplingParams(ignore_eos=True, stop=[stop]),
                     max_tokens=8)[0]
  assert out.text == text[:text.index(stop)], (out.text, text, stop)
  assert (out.finish_reason, out.stop_reason) == ("stop", "stop_string")
  streamed = "".join(c.text for c in llm.stream([PROMPTS[1]], SamplingParams(
      ignore_eos=True, stop=[stop]), max_tokens=8))
  assert streamed == out.text
  _idle(llm)


def test_logprobs_and_per_prompt_settings(llm, dense):
  _, want = dense
  outs = llm.generate(PROMPTS[:2], [SamplingParams(logprobs=3), SamplingParams()],
                      max_tokens=[8, 3])
  first, second = outs
  assert first.token_ids == tuple(want[0]) and second.token_ids == tuple(want[1][:3])
  assert len(first.logprobs) == len(first.token_ids) and second.logprobs is None
  for lp, token in zip(first.logprobs, first.token_ids):
    assert lp.token_id == token and len(lp.top) == 3
    assert lp.top[0] == (token, pytest.approx(lp.logprob))  # greedy: the best one
    assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert lp.logprob <= 0.0


def test_seeded_sampling_is_reproducible(llm):
  sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
  a = llm.generate(PROMPTS[0], sampling, max_tokens=6)[0]
  b = llm.generate([PROMPTS[1], PROMPTS[0]], sampling, max_tokens=6)[1]
  assert a.token_ids == b.token_ids  # whatever shares the batch


def test_n_completions_per_prompt_and_abort_of_them_all(llm, dense):
  _, want = dense
  outs = llm.generate(PROMPTS[:2], SamplingParams(n=3), max_tokens=8)
  assert [(o.sample, o.token_ids) for o in outs] == [
      (i, tuple(w)) for w in want[:2] for i in range(3)]
  assert outs[1].request_id == SampleId(outs[0].request_id, 1)
  hot = dict(temperature=1.0, seed=3)
  alone = [llm.generate(PROMPTS[0], SamplingParams(**dict(hot, seed=3 + i)), max_tokens=6)[0]
           for i in range(2)]
  both = llm.generate(PROMPTS[0], SamplingParams(n=2, **hot), max_tokens=6)
  assert [o.text for o in both] == [o.text for o in alone]
  # `abort` of the request ends its samples too; each streams chunks of its own.
  samples, aborted = set(), None
  for chunk in llm.stream(PROMPTS[1], SamplingParams(n=2, ignore_eos=True), max_tokens=8):
    samples.add(chunk.sample)
    if aborted is None:
      aborted = chunk.request_id
      llm.abort(aborted if chunk.sample == 0 else aborted.parent)
    if chunk.finished:
      assert chunk.finish_reason == "abort"
  assert samples == {0, 1}
  _idle(llm)


def test_prompt_logprobs_equal_the_dense_model(llm, ckpt_dir):
  from paged_kv.model import hf_checkpoint, llama  # pylint: disable=import-outside-toplevel
  model = hf_checkpoint.load_checkpoint(ckpt_dir).model
  ids = llm.engine.encode(PROMPTS[2])
  logits = np.asarray(llama.dense_forward(model, np.asarray([ids], np.int32),
                                          np.array([len(ids)], np.int32)))[0]
  lp = logits - logits.max(-1, keepdims=True)
  lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
  outs = llm.generate(PROMPTS[2], SamplingParams(prompt_logprobs=2, n=2), max_tokens=2)
  for out in outs:  # every sample carries its prompt's
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for t in range(1, len(ids)):
      assert got[t].token_id == ids[t]
      assert got[t].logprob == pytest.approx(lp[t - 1, ids[t]], abs=1e-4)
      assert got[t].rank == 1 + int(np.sum(lp[t - 1] > lp[t - 1, ids[t]] + 1e-6))
      assert [i for i, _ in got[t].top] == np.argsort(-lp[t - 1])[:2].tolist()
  assert llm.generate(PROMPTS[2], max_tokens=2)[0].prompt_logprobs is None
  _idle(llm)


def test_stream_chunks_add_up_and_abort_frees_the_blocks(llm, dense):
  _, want = dense
  chunks = {0: [], 1: []}
  aborted = None
  for chunk in llm.stream(PROMPTS[:2], max_tokens=8):
    chunks[chunk.index].append(chunk)
    if chunk.index == 1 and aborted is None and not chunk.finished:
      aborted = chunk.request_id
      llm.abort(aborted)
      assert llm.scheduler.take_stats().used_blocks > 0  # the other one still runs
  kept = [t for c in chunks[0] for t in c.token_ids]
  assert kept == want[0] and chunks[0][-1].finished
  assert "".join(c.text for c in chunks[0]) == llm.tokenizer.decode(want[0])
  last = chunks[1][-1]
  assert last.request_id == aborted and last.finished and last.finish_reason == "abort"
  assert sum(len(c.token_ids) for c in chunks[1]) < len(want[1]) or len(want[1]) <= 2
  _idle(llm)


def test_two_streams_of_one_llm_interleave(llm, dense):
  _, want = dense
  a, b = llm.stream(PROMPTS[0], max_tokens=8), llm.stream(PROMPTS[2], max_tokens=8)
  got = {0: [], 2: []}
  pending = {0: a, 2: b}
  while pending:  # one chunk from each in turn: each one's steps serve both
    for key, it in list(pending.items()):
      chunk = next(it, None)
      if chunk is None:
        del pending[key]
      else:
        got[key].extend(chunk.token_ids)
  assert got[0] == want[0] and got[2] == want[2]
  _idle(llm)


def test_a_final_only_request_has_one_chunk_with_everything(llm, dense):
  """`Engine.add(final_only=True)` (what `generate` uses): no chunk until it finishes,
  then one with all its tokens, logprobs and text, beside a streamed request; aborted,
  its one chunk holds what it had."""
  _, want = dense
  eng, tok = llm.engine, llm.tokenizer
  whole = eng.add(eng.encode(PROMPTS[0]), SamplingParams(logprobs=1), max_tokens=8,
                  final_only=True)
  streamed = eng.add(eng.encode(PROMPTS[2]), max_tokens=8)
  got = {whole: [], streamed: []}
  while eng.has_work:
    for chunk in eng.step():
      got[chunk.request_id].append(chunk)
  (last,) = got[whole]
  assert last.finished and last.token_ids == tuple(want[0])
  assert last.text == tok.decode(want[0]) and last.num_tokens == len(want[0])
  assert [lp.token_id for lp in last.logprobs] == want[0]
  assert len(got[streamed]) > 1
  assert "".join(c.text for c in got[streamed]) == tok.decode(want[2])
  rid = eng.add(eng.encode(PROMPTS[1]), SamplingParams(ignore_eos=True), max_tokens=8,
                final_only=True)
  while len(eng.request(rid).output) < 3:
    assert eng.step() == []
  chunk = eng.abort(rid)
  assert chunk.finished and chunk.finish_reason == "abort"
  assert len(chunk.token_ids) == chunk.num_tokens >= 3
  assert chunk.text == tok.decode(chunk.token_ids)
  _idle(llm)


def test_closing_a_stream_aborts_what_it_started(llm):
  aborted = llm.scheduler.stats.aborted
  stream = llm.stream(PROMPTS, max_tokens=8)
  next(stream)
  stream.close()
  assert llm.scheduler.stats.aborted - aborted >= 2
  _idle(llm)


def test_context_length_is_refused_with_nothing_queued(llm):
  prompt = llm.engine.encode(PROMPTS[0])
  limit = MAX_POSITIONS - len(prompt)
  with pytest.raises(ContextLengthExceeded) as err:
    llm.generate([PROMPTS[1], PROMPTS[0]], max_tokens=[4, limit + 1])  # the second fails
  assert isinstance(err.value, InvalidArgument)
  assert (err.value.prompt_tokens, err.value.max_tokens, err.value.max_seq_len) == (
      len(prompt), limit + 1, MAX_POSITIONS)
  assert f"maximum context length is {MAX_POSITIONS}" in str(err.value)
  llm.engine.check_context(len(prompt), limit)  # the boundary itself is served
  _idle(llm)


@pytest.mark.parametrize("prompts, kwargs, message", [
    (["ok", [1, 320]], {}, r"must lie in \[0, 320\)"),
    (["ok", [-1, 5]], {}, r"must lie in \[0, 320\)"),
    (["ok", []], {}, "empty prompt"),
    (["ok", 3.5], {}, "a str or a sequence of int"),
    (["a", "b"], dict(max_tokens=[1, 2, 3]), "give one, or one per prompt"),
    (["a", "b"], dict(max_tokens=[4, 0]), "max_tokens must be a positive int"),
    (["a"], dict(sampling="greedy"), "sampling must be a SamplingParams"),
])
def test_bad_inputs_are_refused_with_nothing_queued(llm, prompts, kwargs, message):
  with pytest.raises(InvalidArgument, match=message):
    llm.generate(prompts, **kwargs)
  _idle(llm)


def test_eos_override_and_token_prompts(llm, dense):
  ids, want = dense
  stop = want[2][min(2, len(want[2]) - 1)]  # a greedy token of the id prompt ends it now
  out = llm.generate([ids[2]], SamplingParams(stop_token_ids=(stop,)), max_tokens=8)[0]
  assert out.token_ids == tuple(want[2][:want[2].index(stop) + 1])
  assert out.finish_reason == "stop"
  _idle(llm)


def test_missing_directory_says_so(tmp_path):
  with pytest.raises(InvalidArgument, match="does not exist"):
    LLM(tmp_path / "no-such-dir")
  (tmp_path / "file").write_text("x")
  with pytest.raises(InvalidArgument, match="is not a directory"):
    LLM(tmp_path / "file")
  with pytest.raises(InvalidArgument, match="one of the two"):
    LLM()


def test_pool_sizing_rule():
  kw = dict(block_bytes=1 << 20, block_size=16, max_seq_len=1024, max_batch=8)  # 64 per seq
  # A share of the free memory, in whole blocks.
  s = pool_blocks(**kw, free_bytes=400 << 20, memory_fraction=0.5)
  assert (s.num_blocks, s.budget_bytes) == (200, 200 << 20)
  # Capped at twice max_batch full-length sequences (+1).
  s = pool_blocks(**kw, free_bytes=100 << 30, memory_fraction=0.8)
  assert s.num_blocks == 2 * 8 * 64 + 1 and "capped" in s.rule
  # Overrides.
  assert pool_blocks(**kw, num_blocks=100).num_blocks == 100
  assert pool_blocks(**kw, kv_cache_bytes=300 << 20, free_bytes=1).num_blocks == 300
  # Too little memory for one full-length sequence: refused, naming the numbers.
  with pytest.raises(InvalidArgument, match="one 1024-token sequence needs 65"):
    pool_blocks(**kw, free_bytes=64 << 20, memory_fraction=1.0)
  with pytest.raises(InvalidArgument, match="free memory is unknown"):
    pool_blocks(**kw)
  with pytest.raises(InvalidArgument, match="num_blocks must be an int above the 64"):
    pool_blocks(**kw, num_blocks=64)


def test_default_sizing_reads_free_memory(llm, ckpt_dir, monkeypatch):
  from paged_kv.core import device_memory# pylint: disable=import-outside-toplevel
  from paged_kv.model import hf_checkpoint  # pylint: disable=import-outside-toplevel
  seen = []
  monkeypatch.setattr(device_memory, "free_bytes",
                      lambda device=None: seen.append(1) or 4 << 20)
  model = hf_checkpoint.load_checkpoint(ckpt_dir).model
  small = LLM(model=model, tokenizer=None, max_seq_len=64, max_batch=2, block_size=8)
  block_bytes = small.sizing.block_bytes
  assert seen and small.sizing.num_blocks == min(int(0.25 * (4 << 20)) // block_bytes,
                                                 2 * 2 * 8 + 1)
  assert small.scheduler.pool.config.num_blocks == small.sizing.num_blocks
  with pytest.raises(InvalidArgument, match="this model has no tokenizer"):
    small.generate("text")
  with pytest.raises(InvalidArgument, match="needs max_seq_len"):
    LLM(model=model)
  assert np.asarray(model.config.vocab_size) == 320

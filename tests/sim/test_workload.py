"""`paged_kv.sim.workload`: the fixed workloads and the chat shape."""

from __future__ import annotations

import numpy as np
import pytest

from paged_kv.sim import workload
from tests.sim.trace_files import session_trace, write_mooncake


def test_random_workload():
  wl = workload.random_workload(5, 12, 4, 100, seed=0)
  assert len(wl) == 5 and wl.output_lens == (4,) * 5 and wl.output_tokens == 20
  assert all(p.shape == (12,) and p.dtype == np.int32 for p in wl.prompts)
  assert min(int(p.min()) for p in wl.prompts) >= workload.FIRST_TOKEN_ID
  assert max(int(p.max()) for p in wl.prompts) < 100
  assert wl.max_seq_len == 16 and wl.mean_context == 14.0
  again = workload.random_workload(5, 12, 4, 100, seed=0)
  assert all(np.array_equal(a, b) for a, b in zip(wl.prompts, again.prompts))


def test_shadow_workload_has_the_lengths_and_other_prompts():
  wl = workload.Workload(
      (np.arange(3, 8, dtype=np.int32), np.arange(3, 6, dtype=np.int32)), (4, 2), "x")
  shadow = workload.shadow_workload(wl, 1000, seed=1)
  assert [len(p) for p in shadow.prompts] == [5, 3] and shadow.output_lens == (4, 2)
  assert not any(np.array_equal(a, b) for a, b in zip(wl.prompts, shadow.prompts))


def test_trace_workload_keeps_shared_prefixes_and_caps(tmp_path):
  path = write_mooncake(tmp_path / "t.jsonl", session_trace(seed=1, num=20, num_sessions=3))
  wl = workload.trace_workload(path, 6, 1000, scale=16, max_prompt_len=64, max_output_len=8)
  assert len(wl) == 6 and max(map(len, wl.prompts)) <= 64 and max(wl.output_lens) <= 8
  assert all(workload.FIRST_TOKEN_ID <= int(p.min()) and int(p.max()) < 1000 for p in wl.prompts)
  # Every prompt starts with the trace's shared block (hash 0): 512 / 16 tokens.
  assert all(np.array_equal(p[:32], wl.prompts[0][:32]) for p in wl.prompts)
  later = workload.trace_workload(path, 6, 1000, skip=6, scale=16, max_prompt_len=64,
                            max_output_len=8)
  assert "requests 6-12" in later.source
  with pytest.raises(ValueError, match="needed"):
    workload.trace_workload(path, 30, 1000, max_prompt_len=64, max_output_len=8)


def test_chat_requests_share_the_system_prompt_and_keep_to_the_ranges():
  shape = workload.ChatShape(system_len=10, own_lens=(1, 30), output_lens=(2, 20),
                             vocab=(0, 100), forced_len=20)
  reqs = workload.ChatWorkload(shape, seed=4).requests(40, id_prefix="r",
                                                        namespaces=("a", "b"))
  assert [r.request_id for r in reqs[:3]] == ["r0", "r1", "r2"]
  assert [r.namespace for r in reqs[:3]] == ["a", "b", "a"]
  system = reqs[0].prompt[:10]
  for r in reqs:
    np.testing.assert_array_equal(r.prompt[:10], system)
    assert 1 <= len(r.prompt) - 10 < 30 and 2 <= r.max_new_tokens < 20
    assert 0 <= int(r.prompt.min()) and int(r.prompt.max()) < 100
    assert r.forced_output.shape == (20,) and 100 <= int(r.forced_output.min())
  again = workload.ChatWorkload(shape, seed=4).requests(40)
  assert all(np.array_equal(a.prompt, b.prompt) and a.max_new_tokens == b.max_new_tokens
             for a, b in zip(reqs, again))
  assert [r.request_id for r in again[:2]] == [0, 1] and again[0].namespace == "default"


def test_chat_draws_in_the_documented_order():
  """Share of the system prompt, suffix length, suffix, output length, forced output."""
  shape = workload.ChatShape(system_len=40, own_lens=(8, 60), output_lens=(1, 16),
                             vocab=(0, 1000), own_vocab=(1000, 5000), shared_lens=(1, 40),
                             forced_len=16, forced_vocab=(100, 200))
  got = workload.ChatWorkload(shape, seed=7).requests(6)
  rng = np.random.default_rng(7)
  system = rng.integers(0, 1000, 40)
  for r in got:
    prompt = np.concatenate([system[:rng.integers(1, 40)],
                             rng.integers(1000, 5000, int(rng.integers(8, 60)))])
    np.testing.assert_array_equal(r.prompt, prompt)
    assert r.max_new_tokens == int(rng.integers(1, 16))
    np.testing.assert_array_equal(r.forced_output, rng.integers(100, 200, 16))
  assert all(r.forced_output is None for r in workload.ChatWorkload(
      workload.ChatShape.host_benchmark(16), seed=0).requests(3))


class _Queue:
  """What `top_up` reads of a scheduler."""

  def __init__(self):
    self.running, self.waiting = [], []

  def submit(self, req):
    self.waiting.append(req)


def test_top_up_fills_to_the_batch_and_numbers_the_requests():
  chat = workload.ChatWorkload(workload.ChatShape.host_benchmark(16), seed=1)
  sched = _Queue()
  chat.top_up(sched, 5)
  assert [r.request_id for r in sched.waiting] == [0, 1, 2, 3, 4]
  assert all(len(r.prompt) - 64 in range(1, 48) and 16 <= r.max_new_tokens < 128
             for r in sched.waiting)
  sched.running = sched.waiting[:2]
  sched.waiting = sched.waiting[3:]  # one finished
  chat.top_up(sched, 5)
  assert [r.request_id for r in sched.waiting] == [3, 4, 5]
  chat.top_up(sched, 5)
  assert chat.num_drawn == 6


@pytest.mark.parametrize("kwargs, match", [
    (dict(own_lens=(5, 5)), "own_lens"),
    (dict(own_lens=[1, 5]), "own_lens"),
    (dict(output_lens=(0, 4)), "output_lens"),
    (dict(vocab=(10, 2)), "vocab"),
    (dict(own_vocab=(1, 1)), "own_vocab"),
    (dict(shared_lens=(1, 12)), "exceeds"),
    (dict(system_len=-1), "system_len"),
    (dict(forced_len=-2), "forced_len"),
    (dict(forced_len=2), "shorter"),
])
def test_chat_shape_rejects_bad_ranges(kwargs, match):
  base = dict(system_len=10, own_lens=(1, 4), output_lens=(1, 4))
  with pytest.raises(ValueError, match=match):
    workload.ChatShape(**{**base, **kwargs})


def test_chat_workload_wants_a_shape():
  with pytest.raises(TypeError, match="ChatShape"):
    workload.ChatWorkload(dict(system_len=4), seed=0)

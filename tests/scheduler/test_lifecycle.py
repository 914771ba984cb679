"""The request lifecycle: abort in every phase, inputs frozen at submit, unique live
ids, and the token stream (`StepReport.tokens`, `streaming.generate`).

After every abort the invariants hold, the other requests finish with the tokens they
get without it, and once drained the pool holds nothing but the cache (evicted: empty).
"""

from __future__ import annotations

import inspect

import numpy as np
from absl.testing import absltest, parameterized
import pytest

import paged_kv
from paged_kv.scheduler import UnknownRequest
from paged_kv.scheduler.scheduler import DryExecutor, Phase, Request, Scheduler, SchedulerConfig
from paged_kv.scheduler.streaming import generate
from paged_kv.sim.workload import ChatShape, ChatWorkload

CFG = paged_kv.PoolConfig(num_blocks=64, block_size=4, num_layers=1, num_kv_heads=1,
                          head_dim=2, max_seqs=8, max_segments=40)
SCHED = SchedulerConfig(max_batch=8, prefill_chunk=8, prefill_token_budget=16,
                        output_reserve_ratio=0.0)


def _requests(seed: int, n: int = 10) -> list[Request]:
  return ChatWorkload(ChatShape(system_len=8, own_lens=(1, 30), output_lens=(2, 20),
                                vocab=(0, 100), forced_len=20), seed).requests(n, id_prefix="r")


def _drain(sched: Scheduler, limit: int = 3000) -> None:
  for _ in range(limit):
    if sched.idle:
      return
    sched.step()
    sched.check_invariants()
  raise AssertionError("no progress")


def _assert_empty(test, sched: Scheduler) -> None:
  test.assertEqual(sched.pool.active_sequences().size, 0)
  sched.evictor.evict(CFG.num_blocks)
  test.assertEqual(sched.pool.num_free_blocks, CFG.num_blocks)
  sched.check_invariants()


class AbortTest(parameterized.TestCase):

  def _sched(self, **kw):
    cfg = SchedulerConfig(**{**SCHED.__dict__, **kw}) if kw else SCHED
    return Scheduler(paged_kv.BlockPool(CFG), DryExecutor(CFG), cfg)

  @parameterized.parameters("waiting", "prefill", "decode")
  def test_abort_in_each_phase(self, phase):
    sched = self._sched()
    reqs = _requests(0)
    for r in reqs:
      sched.submit(r)
    victim = None
    for _ in range(200):
      cands = {
          "waiting": [r for r in sched.waiting],
          "prefill": [r for r in sched.running if r.num_cached < r.prompt.size and r.num_cached],
          "decode": [r for r in sched.running if r.output and not r.done],
      }[phase]
      if cands:
        victim = cands[-1]
        break
      sched.step()
    self.assertIsNotNone(victim, f"never saw a request in phase {phase}")
    held = victim.seq_id
    out_before = list(victim.output)
    got = sched.abort(victim.request_id)
    self.assertIs(got, victim)
    self.assertTrue(victim.done)
    self.assertEqual(victim.stop_reason, "abort")
    self.assertEqual(victim.output, out_before)
    self.assertIsNone(victim.seq_id)
    self.assertNotIn(victim, sched.running)
    self.assertNotIn(victim, sched.waiting)
    if held is not None:
      self.assertFalse(sched.pool.host.active[held])  # its row went at once
    self.assertEqual(sched.stats.aborted, 1)
    self.assertIn(victim, sched.finished)
    sched.check_invariants()
    reports = []
    sched.on_step = reports.append
    _drain(sched)
    reported = [r for rep in reports for r in rep.finished]
    self.assertEqual(reported.count(victim), 1)  # once, in the next step's report
    self.assertIn(victim, reports[0].finished)
    for r in reqs:
      self.assertTrue(r.done)
      if r is not victim:
        self.assertEqual(r.stop_reason, "length")
        np.testing.assert_array_equal(r.output, r.forced_output[:r.max_new_tokens])
    self.assertEqual(sched.stats.finished, len(reqs))
    _assert_empty(self, sched)

  @pytest.mark.slow
  def test_abort_a_swapped_request(self):
    sched = Scheduler(paged_kv.BlockPool(CFG), DryExecutor(CFG),
                      SchedulerConfig(max_batch=8, prefill_chunk=16, prefill_token_budget=32,
                                      preemption="swap", output_reserve_ratio=0.0))
    rng = np.random.default_rng(0)
    reqs = [Request(i, rng.integers(0, 100, rng.integers(1, 30)), int(rng.integers(10, 30)),
                    forced_output=rng.integers(100, 200, 30)) for i in range(24)]
    for r in reqs:
      sched.submit(r)
    for _ in range(500):
      if sched.swapped:
        break
      sched.step()
    self.assertTrue(sched.swapped, "the small pool never swapped")
    victim = sched.swapped[0]
    self.assertEqual(victim.phase, Phase.SWAPPED)
    sched.abort(victim.request_id)
    self.assertIsNone(victim.swapped)
    self.assertNotIn(victim, sched.swapped)
    _drain(sched)
    self.assertEqual(sum(r.stop_reason == "abort" for r in reqs), 1)
    self.assertTrue(all(r.done for r in reqs))
    _assert_empty(self, sched)

  def test_unknown_and_finished_ids_are_refused(self):
    sched = self._sched()
    req = _requests(1, n=1)[0]
    with self.assertRaises(UnknownRequest):
      sched.abort("nobody")
    with self.assertRaises(UnknownRequest):
      sched.abort(["unhashable"])
    sched.submit(req)
    _drain(sched)
    with self.assertRaisesRegex(UnknownRequest, "no unfinished request"):
      sched.abort(req.request_id)  # finished already
    self.assertIsInstance(UnknownRequest("x"), KeyError)
    self.assertEqual(sched.stats.aborted, 0)


class SubmitTest(absltest.TestCase):

  def test_inputs_are_frozen_at_submit(self):
    sched = Scheduler(paged_kv.BlockPool(CFG), DryExecutor(CFG), SCHED)
    prompt = np.arange(12)
    req = Request("a", prompt, 3, namespace="t0")
    other = Request("b", np.arange(12), 3, namespace="t1")
    sched.submit(req)
    sched.submit(other)
    prompt[:] = -5  # the caller's array: no effect
    np.testing.assert_array_equal(req.prompt, np.arange(12))
    with self.assertRaises(ValueError):
      req.prompt[0] = 7  # the request's copy is read-only
    for name, value in (("namespace", ["t"]), ("prompt", np.arange(3.0)),
                        ("max_new_tokens", 10**9), ("request_id", "z"),
                        ("forced_output", np.arange(3))):
      with self.assertRaisesRegex(paged_kv.InvalidArgument, f"its {name} is frozen"):
        setattr(req, name, value)
    self.assertEqual(req.namespace, "t0")
    _drain(sched)
    self.assertTrue(req.done and other.done)
    self.assertEqual(len(req.output), 3)

  def test_constructor_takes_the_inputs_only(self):
    params = list(inspect.signature(Request).parameters)
    self.assertEqual(params, ["request_id", "prompt", "max_new_tokens", "namespace", "arrival",
                              "forced_output", "sampling"])
    with self.assertRaises(TypeError):
      Request("a", np.arange(3), 2, num_cached=2)  # progress is the scheduler's

  def test_ids_are_unique_among_live_requests(self):
    sched = Scheduler(paged_kv.BlockPool(CFG), DryExecutor(CFG), SCHED)
    sched.submit(Request("a", np.arange(5), 2))
    with self.assertRaisesRegex(paged_kv.InvalidArgument, "in use"):
      sched.submit(Request("a", np.arange(7), 2))
    with self.assertRaisesRegex(paged_kv.InvalidArgument, "hashable"):
      sched.submit(Request(["x"], np.arange(7), 2))
    _drain(sched)
    again = Request("a", np.arange(7), 2)
    sched.submit(again)  # finished ids may come back
    _drain(sched)
    self.assertTrue(again.done)


class StreamTest(absltest.TestCase):

  def test_stream_equals_the_outputs_and_the_step_reports(self):
    reports = []
    sched = Scheduler(paged_kv.BlockPool(CFG), DryExecutor(CFG), SCHED,
                      on_step=reports.append)
    reqs = _requests(2)
    streamed: dict = {r.request_id: [] for r in reqs}
    ends = {}
    last_step = -1
    for out in generate(sched, reqs):
      self.assertGreaterEqual(out.step, last_step)
      last_step = out.step
      self.assertNotIn(out.request_id, ends)  # nothing after its last output
      streamed[out.request_id].extend(out.new_tokens)
      self.assertEqual(out.num_tokens, len(streamed[out.request_id]))
      if out.finished:
        ends[out.request_id] = out.stop_reason
    self.assertEqual(set(ends), set(streamed))
    for r in reqs:
      self.assertEqual(streamed[r.request_id], r.output)
      self.assertEqual(ends[r.request_id], "length")
    self.assertIs(sched.on_step.__self__, reports)  # the caller's callback is back
    from_reports: dict = {}
    for rep in reports:
      for rid, token in rep.tokens:
        from_reports.setdefault(rid, []).append(token)
    self.assertEqual(from_reports, {r.request_id: r.output for r in reqs})

  def test_sampled_tokens_stream_too(self):
    """Requests without forced output take the decode loop's inlined emit."""
    sched = Scheduler(paged_kv.BlockPool(CFG), DryExecutor(CFG), SCHED)
    reqs = [Request(f"s{i}", np.arange(3 + i), 5) for i in range(3)]
    streamed: dict = {}
    for out in generate(sched, reqs):
      streamed.setdefault(out.request_id, []).extend(out.new_tokens)
    self.assertEqual(streamed, {r.request_id: r.output for r in reqs})
    self.assertTrue(all(len(r.output) == 5 for r in reqs))

  def test_abort_while_streaming_ends_that_stream(self):
    sched = Scheduler(paged_kv.BlockPool(CFG), DryExecutor(CFG), SCHED)
    reqs = _requests(3, n=4)
    seen: dict = {}
    for out in generate(sched, reqs):
      seen.setdefault(out.request_id, []).append(out)
      if out.request_id == "r1" and out.num_tokens == 1 and not out.finished:
        sched.abort("r1")
    last = seen["r1"][-1]
    self.assertTrue(last.finished)
    self.assertEqual((last.stop_reason, last.new_tokens, last.step), ("abort", (), -1))
    self.assertEqual(sum(len(o.new_tokens) for o in seen["r1"]), 1)
    self.assertTrue(all(seen[r.request_id][-1].finished for r in reqs))
    _assert_empty(self, sched)

  def test_duplicate_ids_refused_before_any_step(self):
    sched = Scheduler(paged_kv.BlockPool(CFG), DryExecutor(CFG), SCHED)
    with self.assertRaises(paged_kv.InvalidArgument):
      list(generate(sched, [Request("a", [1, 2], 2), Request("a", [3], 2)]))
    self.assertTrue(sched.idle)


if __name__ == "__main__":
  absltest.main()

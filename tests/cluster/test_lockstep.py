"""`LockstepScheduler`, `Channel` and the request wire format, in one process (fast).

The multi-process behaviour (broadcasts, digests compared across processes,
failures) is in `test_multiprocess.py`; here: a one-process lockstep run equals
a plain `Scheduler`, the refusals, and the encoding of requests.
"""

from __future__ import annotations

import numpy as np
import pytest

import paged_kv
from paged_kv.core.errors import InvalidArgument
from paged_kv.cluster import distributed, lockstep
from paged_kv.scheduler.executor import DryExecutor
from paged_kv.scheduler.sampling_params import SamplingParams
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig

CONFIG = paged_kv.PoolConfig(num_blocks=24, block_size=4, num_layers=1, num_kv_heads=2,
                             head_dim=8, max_seqs=4, max_segments=16)
SCHED = SchedulerConfig(max_batch=4, prefill_chunk=8, prefill_token_budget=16,
                        output_reserve_ratio=0.0, snapshot_every=0)


def _requests(prefix: str = "r") -> list[Request]:
  rng = np.random.default_rng(0)
  system = rng.integers(0, 100, 6).tolist()
  return [Request(f"{prefix}{i}", np.asarray(system + rng.integers(0, 100, 3 + i).tolist(),
                                             np.int32), 4 + i % 3,
                  forced_output=rng.integers(0, 100, 8).astype(np.int32))
          for i in range(6)]


def _channel() -> distributed.Channel:
  return distributed.Channel(distributed.single_process(), timeout_s=5.0)


@pytest.mark.slow
def test_one_process_lockstep_equals_plain_scheduler():
  plain = Scheduler(paged_kv.BlockPool(CONFIG), DryExecutor(CONFIG), SCHED)
  ls = lockstep.LockstepScheduler(paged_kv.BlockPool(CONFIG), DryExecutor(CONFIG), SCHED,
                                  channel=_channel(), leader_clock=lambda: 7.0)
  reqs_plain, reqs_ls = _requests(), _requests()
  arrivals = lambda step, reqs: reqs[2 * step:2 * step + 2] if 2 * step < len(reqs) else None
  step, done_plain = 0, []
  while True:
    new = arrivals(step, reqs_plain)
    for r in new or ():
      plain.submit(r)
    if new is None and plain.idle:
      break
    plain.step()
    done_plain += plain.take_finished()
    step += 1
  done_ls = ls.serve(lambda s: arrivals(s, reqs_ls))
  assert ls.done and ls.closed
  got = {r.request_id: (r.tokens.tolist(), r.stop_reason) for r in done_ls}
  want = {r.request_id: (r.tokens.tolist(), r.stop_reason) for r in done_plain}
  assert got == want and len(got) == 6
  assert ls.scheduler.stats.evictions == plain.stats.evictions
  assert all(r.submit_time == 7.0 for r in done_ls)  # the leader's clock, broadcast
  assert ls.channel.num_exchanges >= 2 * ls.step_index  # arrivals + digest per step


def test_rejections_are_reported_not_raised():
  ls = lockstep.LockstepScheduler(paged_kv.BlockPool(CONFIG), DryExecutor(CONFIG), SCHED,
                                  channel=_channel())
  huge = Request("huge", np.arange(200, dtype=np.int32), 4)
  result = ls.step([huge, Request("ok", np.arange(5, dtype=np.int32), 2)])
  assert [rid for rid, _ in result.rejected] == ["huge"]
  assert "PoolExhausted" in result.rejected[0][1]
  result = ls.step(aborts=["nope"])
  assert result.rejected[0][0] == "nope" and "UnknownRequest" in result.rejected[0][1]


def test_refusals():
  pool = paged_kv.BlockPool(CONFIG)
  with pytest.raises(InvalidArgument, match="stats_budget"):
    lockstep.LockstepScheduler(pool, DryExecutor(CONFIG),
                               SchedulerConfig(max_batch=4, stats_budget=0.02),
                               channel=_channel())
  with pytest.raises(InvalidArgument, match="leader"):
    lockstep.LockstepScheduler(pool, DryExecutor(CONFIG), SCHED, channel=_channel(),
                               clock=lambda: 0.0)
  ls = lockstep.LockstepScheduler(pool, DryExecutor(CONFIG), SCHED, channel=_channel())
  ls.step(closed=True)
  with pytest.raises(InvalidArgument, match="closed"):
    ls.step([Request("late", np.arange(3, dtype=np.int32), 1)])
  assert ls.step().step == 1  # a refused call changed nothing: the run goes on


def test_request_wire_format_round_trips():
  sp = SamplingParams(temperature=0.7, top_k=5, seed=3, stop_token_ids=(1, 2), logprobs=2)
  for rid, ns in (("a", "default"), (7, b"\x00tenant"), (("t", 1), ("lora", 2, b"x"))):
    r = Request(rid, np.arange(4, dtype=np.int32), 3, namespace=ns, arrival=1.5,
                forced_output=np.arange(3, dtype=np.int32), sampling=sp)
    back = lockstep.decode_request(lockstep.encode_request(r))
    assert (back.request_id, back.namespace, back.max_new_tokens, back.arrival) == (
        rid, ns, 3, 1.5)
    assert back.prompt.tolist() == [0, 1, 2, 3] and back.forced_output.tolist() == [0, 1, 2]
    assert back.sampling == sp and back is not r


@pytest.mark.parametrize("bad", [1.5, True, np.int32(3), None])
def test_request_ids_must_travel(bad):
  r = Request("x", np.arange(2, dtype=np.int32), 1)
  object.__setattr__(r, "request_id", bad)
  with pytest.raises(InvalidArgument, match="travel between processes"):
    lockstep.encode_request(r)


def test_one_process_channel():
  ch = _channel()
  assert ch.broadcast("x") == "x"
  assert ch.exchange("y") == ["y"]
  ch.agree("label", "d")
  ch.report_failure(RuntimeError("nothing to tell"))  # no peers: a no-op
  assert ch.num_exchanges == 3


def test_schedule_diverged_names_the_processes():
  e = distributed.ScheduleDiverged("step", 4, {0: "aa", 1: "bb", 2: "aa"})
  assert "step 4 (step)" in str(e) and "processes [0, 2]: aa" in str(e)
  assert "processes [1]: bb" in str(e) and e.digests == {0: "aa", 1: "bb", 2: "aa"}
  assert isinstance(e, paged_kv.PagedKVError)


def test_initialize_without_environment_is_one_process(monkeypatch):
  for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
               distributed.ENV_PROCESS_ID):
    monkeypatch.delenv(name, raising=False)
  group = distributed.initialize()
  assert (group.process_id, group.num_processes, group.is_leader) == (0, 1, True)
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
  with pytest.raises(InvalidArgument, match="needs coordinator"):
    distributed.initialize()
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
  with pytest.raises(InvalidArgument, match="must be an int"):
    distributed.initialize()


def test_sharded_executor_leaves_the_model_alone():
  from paged_kv.model import llama  # pylint: disable=g-import-not-at-top
  from paged_kv.model.nnx_import import nnx  # pylint: disable=g-import-not-at-top
  from paged_kv.parallel import executor, sharding  # pylint: disable=g-import-not-at-top
  mc = llama.LlamaConfig(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8, d_model=16,
                         ffn_dim=16)
  model = llama.TinyLlama(mc, rngs=nnx.Rngs(0))
  pc = llama.pool_config_for(mc, num_blocks=8, block_size=4, max_seqs=2, max_segments=4)
  ex = executor.ShardedModelExecutor(model, pc, sharding.make_tp_mesh(1))
  from paged_kv.model.layers import PagedAttention  # pylint: disable=g-import-not-at-top
  attns = [n for _, n in nnx.iter_graph(model) if isinstance(n, PagedAttention)]
  assert attns and all(a.activation_sharding is None for a in attns)
  with pytest.raises(ValueError, match="no axis"):
    executor.ShardedModelExecutor(model, pc, sharding.make_tp_mesh(1, axis="model"))
  assert ex.exact and ex.samples

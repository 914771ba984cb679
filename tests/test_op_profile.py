"""The per-op device time from JAX's profiler (`paged_kv.runtime.op_profile`): a real
trace on this CPU, and the GPU trace's layout (device planes, the `XLA Ops` line, the
stream lines without it) from hand-written traces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.profiler import ProfileData

from paged_kv.runtime import op_profile


def _gpu_trace(with_ops_line: bool) -> ProfileData:
  ops_line = """
  lines { id: 2 name: "XLA Ops"
    events { metadata_id: 1 offset_ps: 0 duration_ps: 2000000 }
    events { metadata_id: 2 offset_ps: 2000000 duration_ps: 1000000 }
    events { metadata_id: 1 offset_ps: 3000000 duration_ps: 2000000 }
    events { metadata_id: 5 offset_ps: 5000000 duration_ps: 500000 } }""" if with_ops_line else ""
  return ProfileData.from_text_proto(f"""
planes {{
  id: 1
  name: "/device:GPU:0"
  lines {{ id: 1 name: "XLA Modules"
    events {{ metadata_id: 3 offset_ps: 0 duration_ps: 9000000 }} }}
  {ops_line}
  lines {{ id: 3 name: "Stream #1(Compute)"
    events {{ metadata_id: 4 offset_ps: 0 duration_ps: 7000000 }}
    events {{ metadata_id: 2 offset_ps: 7000000 duration_ps: 1000000 }} }}
  event_metadata {{ key: 1 value {{ id: 1 name: "gemm_fusion_dot.3" }} }}
  event_metadata {{ key: 2 value {{ id: 2 name: "paged_attention_decode" }} }}
  event_metadata {{ key: 3 value {{ id: 3 name: "jit_decode_multi" }} }}
  event_metadata {{ key: 4 value {{ id: 4 name: "sm90_xmma_gemm_bf16bf16" }} }}
  event_metadata {{ key: 5 value {{ id: 5 name: "loop_add_fusion" }} }}
}}
planes {{ id: 2 name: "/host:CPU"
  lines {{ id: 1 name: "python" events {{ metadata_id: 1 offset_ps: 0 duration_ps: 5 }} }}
  event_metadata {{ key: 1 value {{ id: 1 name: "PjitFunction(step)" }} }} }}
""")


def test_the_xla_ops_line_of_a_device_plane_is_the_measurement():
  ops, source = op_profile.aggregate(_gpu_trace(with_ops_line=True).planes)
  assert source == "device:XLA Ops"
  assert ops == (("gemm_fusion_dot.3", 4000.0, 2), ("paged_attention_decode", 1000.0, 1),
                 ("loop_add_fusion", 500.0, 1))  # the module and host events left out
  profile = op_profile.OpProfile(ops, source, runs=2)
  assert profile.total_ns == 5500.0
  assert profile.categories() == {"attention": 1000.0, "matmul": 4000.0, "sort / top-k": 0.0,
                                  "data movement": 0.0, "other": 500.0}
  line = profile.summary(per="step")
  assert line.startswith("ops 0.003 ms per step (device:XLA Ops): attention 0.001 ms (18%)")
  assert "top: gemm_fusion_dot.3 0.002 ms; paged_attention_decode 0.001 ms" in line


def test_without_an_ops_line_the_stream_kernels_are_summed():
  ops, source = op_profile.aggregate(_gpu_trace(with_ops_line=False).planes)
  assert source == "device:streams"
  assert dict((n, ns) for n, ns, _ in ops) == {"sm90_xmma_gemm_bf16bf16": 7000.0,
                                                "paged_attention_decode": 1000.0}


def test_a_cpu_trace_names_the_ops_xla_ran():
  f = jax.jit(lambda x, w: jnp.sort(jnp.tanh(x @ w), axis=-1)[:, :4])
  x, w = jnp.ones((128, 256)), jnp.ones((256, 256))
  f(x, w).block_until_ready()  # compiled outside the trace
  profile = op_profile.profile_ops(lambda: f(x, w), runs=2)
  assert profile.source == "host:XLA execute" and profile.runs == 2
  names = [name for name, _, _ in profile.ops]
  assert any(op_profile.categorize(n) == "sort / top-k" for n in names), names
  assert not any(n.startswith(("ThreadpoolListener", "ThunkExecutor", "end: ")) for n in names)
  assert profile.total_ns > 0 and "per run (host:XLA execute)" in profile.summary()


@pytest.mark.parametrize("name, category", [
    ("custom-call.mosaic_gpu_paged_attention", "attention"), ("cublas_gemm.1", "matmul"),
    ("dot.12", "matmul"), ("sort.0", "sort / top-k"), ("copy_fusion.3", "data movement"),
    ("loop_multiply_fusion", "other")])
def test_categories(name, category):
  assert op_profile.categorize(name) == category


def test_an_enclosing_op_keeps_only_its_own_time():
  """A loop op around its body's ops (XLA:CPU's `while`): no time counted twice."""
  trace = ProfileData.from_text_proto("""
planes { id: 1 name: "/host:CPU"
  lines { id: 1 name: "tf_XLAExecute/1"
    events { metadata_id: 1 offset_ps: 0 duration_ps: 10000000 }
    events { metadata_id: 2 offset_ps: 1000000 duration_ps: 3000000 }
    events { metadata_id: 3 offset_ps: 2000000 duration_ps: 1000000 }
    events { metadata_id: 2 offset_ps: 5000000 duration_ps: 3000000 }
    events { metadata_id: 4 offset_ps: 12000000 duration_ps: 1000000 } }
  event_metadata { key: 1 value { id: 1 name: "while.7" } }
  event_metadata { key: 2 value { id: 2 name: "dot.1" } }
  event_metadata { key: 3 value { id: 3 name: "sort.2" } }
  event_metadata { key: 4 value { id: 4 name: "end: while.7" } } }
""")
  ops, source = op_profile.aggregate(trace.planes)
  assert source == "host:XLA execute"
  assert {n: ns for n, ns, _ in ops} == {"while.7": 4000.0, "dot.1": 5000.0, "sort.2": 1000.0}


def test_a_profiler_failure_leaves_the_timing_and_says_why(monkeypatch):
  """`serving_bench.device_step(profile=True)` keeps its seconds when the profiler
  cannot trace (a GPU without CUPTI, a trace already running): the reason instead."""
  from paged_kv.sim import serving_bench  # pylint: disable=import-outside-toplevel
  f = jax.jit(lambda x: jnp.sort(x @ x, axis=-1))
  x = jnp.ones((128, 128))
  f(x).block_until_ready()
  ops, error = serving_bench._profiled(lambda: f(x), runs=4)  # pylint: disable=protected-access
  assert error is None and ops.runs == 4 and ops.source == "host:XLA execute"

  def broken(fn, **kwargs):
    raise RuntimeError("no CUPTI here")
  monkeypatch.setattr(op_profile, "profile_ops", broken)
  ops, error = serving_bench._profiled(lambda: f(x), runs=4)  # pylint: disable=protected-access
  assert ops is None and error == "RuntimeError: no CUPTI here"
  step = serving_bench.DeviceStep(0.5, ops, error)
  assert step.ops_summary("step") == "no per-op profile: RuntimeError: no CUPTI here"

"""Test-session settings shared by every test module.

Four things, all about running ~1,160 tests in two long-lived xdist workers on a
2-core CPU machine (the fourth, the tiers `slow` and `long`, is at the end of the file):

1. **Memory mappings.** Every XLA CPU executable holds about 30 memory mappings
   (measured: 300 small jitted programs took a process from 422 to 10,384 lines of
   ``/proc/self/maps``), and JAX keeps each one alive in its caches while its
   jitted function lives (a module-level ``jax.jit`` lives for the session).
   A worker that keeps ~2,000 programs reaches Linux's ``vm.max_map_count``
   (65,530 by default); from then on ``mmap`` fails inside
   XLA's compiler and the worker dies with a segmentation fault in
   ``backend_compile_and_load``, in whichever program it happened to be
   compiling (``tools/map_limit_repro.py`` shows it).  After each test we count
   the mappings and, above half the limit, drop JAX's caches
   (``jax.clear_caches()``), which unmaps them.

2. **Compile time.** Much of the suite's time is XLA compiling small programs.
   Unless ``XLA_FLAGS`` already names an optimisation level, the tests run with
   ``--xla_backend_optimization_level=0`` (``tests/test_review_regressions.py``:
   60 s -> 46 s, one run each; the whole suite 24.5 -> 16.7 min with this file).
   It changes how fast the CPU code is, not what it computes.
   ``PAGED_KV_TEST_XLA_OPT=default`` keeps XLA's default.

3. **Thread pools for the Mosaic GPU interpreter.** XLA:CPU's pools get
   ``PJRT_NPROC=8`` threads (unless set) before the CPU client exists: with one
   per core (2 here) a kernel whose warpgroups wait on each other's barriers could
   deadlock in interpret mode (``pallas_kernels/lowering.py``).
"""

from __future__ import annotations

import gc
import os

_OPT_FLAG = "--xla_backend_optimization_level"
if os.environ.get("PAGED_KV_TEST_XLA_OPT", "") != "default":
  _flags = os.environ.get("XLA_FLAGS", "")
  if _OPT_FLAG not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} {_OPT_FLAG}=0".strip()

# The Mosaic GPU interpreter (interpret-mode kernel tests) needs XLA:CPU thread
# pools wider than this 2-core machine's 2 threads, set before JAX creates its CPU
# client (`lowering.reserve_cpu_threads_for_gpu_interpreter` says why).
from pallas_kernels import lowering as _lowering  # noqa: E402

_lowering.reserve_cpu_threads_for_gpu_interpreter()

_MAPS = "/proc/self/maps"


def _map_limit() -> int:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return 65530


_CLEAR_ABOVE = _map_limit() // 2


def _mapping_count() -> int:
  with open(_MAPS, "rb") as f:
    return sum(1 for _ in f)


def pytest_runtest_teardown(item, nextitem):
  del item, nextitem
  if not os.path.exists(_MAPS):  # not Linux: no per-process mapping limit to watch
    return
  if _mapping_count() > _CLEAR_ABOVE:
    import jax  # pylint: disable=g-import-not-at-top
    jax.clear_caches()
    gc.collect()


# `make test-fast` (`pytest -m "not slow"`, the edit-test loop) leaves out the
# whole-system runs and the slowest unit tests: the tests below took 3-100 s each on
# 2 cores (`pytest --durations=100`, 2026-12-03), together most of the suite's time. `make test` (CI) runs everything. Paths relative to tests/; a directory
# or a module marks all its tests, `module::Class` a class, `module::test` one test.
_SLOW = (
    "examples/",  # the example scripts' smoke runs (subprocesses)
    "test_readme.py",  # the README's code, run as written
    "test_pool_stateful.py",  # hypothesis state machines
    "test_host_memory.py",
    "mirror/test_transitions_match.py",
    "kernels/test_gpu_check.py",
    "kernels/test_mosaic_attention.py",  # Mosaic GPU interpret mode with race checks
    "parallel/test_sharding.py",
    "serving/test_serving_equivalence.py",
    "serving/test_llm.py",  # the facade, and the server on 127.0.0.1 (10-20 s each)
    "serving/test_openai_server.py",
    "serving/test_openai_api.py::test_python_m_paged_kv_serve",
    "serving/test_exception_safety.py",
    "serving/test_runtime_discipline.py",
    "serving/test_tenant_isolation.py",
    "serving/test_persist.py::BitFlipSweepTest",
    "serving/test_persist.py::CrashMidSaveTest",
    "serving/test_sampling.py::ServeTest",
    "serving/test_shrink.py::ShrinkWhileServingTest",
    "serving/test_scheduler.py::IssueJRegressionTest",
    "serving/test_scheduler.py::PackTailsTest",
    "test_review_regressions.py::test_pack_tails_with_promotion_does_not_crash",
    # 3-10 s each (the same measurement), and the session-10 tests of 4-18 s.
    "test_review_regressions.py::test_guard_scrub_zeroes_every_free_block_after_moves_and_keeps_live_kv",
    "test_review_regressions.py::test_recompute_preemption_with_cache_preempts_only_what_is_needed",
    "test_review_regressions.py::test_allocate_best_fit_prefers_shortest_run_on_large_pool",
    "test_input_validation.py::NoOpMoveTest",
    "test_input_validation.py::ApplyRefDeltasTransitionTest",
    "test_imports.py::ImportTest::test_core_loads_no_optional_dependency",
    "test_imports.py::ImportTest::test_nothing_imports_examples",
    "core/test_transitions.py::TransitionTest::test_reserve_failures_leave_rows_untouched__without_jit",
    "core/test_transitions.py::TransitionTest::test_reserve_failures_leave_rows_untouched__with_jit",
    "core/test_transitions.py::TransitionTest::test_allocate_lowest_first_and_contiguous__without_jit",
    "core/test_free_index.py::AllocateTest",
    "core/test_slots.py::PackSlotsTest::test_external_short_segments_share_one_fresh_block__without_jit",
    "core/test_slots.py::CowSplitTest::test_forked_tail_is_copied_and_appends_continue_in_place__without_jit",
    "model/test_model_equivalence.py::test_steps_donate_state_and_compile_once",
    "model/test_model_equivalence.py::test_shared_prefixes_match_dense",
    "model/test_steps.py::test_mixed_step_matches_dense_and_compiles_once",
    "model/test_layers.py::PagedAttentionLayerTest::test_paged_steps_equal_dense_attention__with_jit",
    "model/test_hf_checkpoint.py::test_served_greedy_equals_dense",
    "model/test_random_checkpoint.py::test_served_tokens_equal_the_dense_reference_and_follow_the_context",
    "model/test_logits_indices.py::test_same_tokens_and_logits_with_and_without_indices",
    "model/test_logits_indices.py::test_compiled_prefill_runs_the_head_on_the_rows_only",
    "kernels/test_prefill_attention.py::test_prefill_tile_does_not_stream_future_pages",
    "kernels/test_prefill_attention.py::test_pallas_default_tile_matches_reference",
    "serving/test_replicas.py::test_dead_and_hung_replicas_are_routed_around",
    "serving/test_replicas.py::test_routes_over_processes_and_reuses_prefixes",
    "serving/test_replicas.py::test_wall_clock_replicas_and_an_exception_inside_the_set",
    "serving/test_replicas.py::test_server_commands_in_process",
    "parallel/test_lockstep.py::test_one_process_lockstep_equals_plain_scheduler",
    "serving/test_scheduler.py::PromotionTest",
    "serving/test_scheduler.py::SchedulerTest::test_compaction_runs_and_cache_follows_remap",
    "serving/test_scheduler.py::SchedulerTest::test_namespaces_do_not_share",
    "serving/test_scheduler.py::SchedulerTest::test_unlimited_pool_hits_exact_prefix_bound",
    "serving/test_step_report.py::StepStatsTest",
    "serving/test_step_report.py::StepReportTest::test_stats_budget_paces_the_figures",
    "serving/test_step_report.py::StepReportTest::test_alerts_fire_in_the_step_they_cross",
    "serving/test_step_report.py::NoPerBlockHostReadsTest",
    "serving/test_engine_replay.py::EngineReplayTest::test_small_trace_finishes_with_hits",
    "serving/test_lifecycle.py::AbortTest::test_abort_a_swapped_request",
    "serving/test_routing.py::ScriptTest",
    "serving/test_governance.py::QuotaTest::test_a_tiny_quota_never_stalls",
    "telemetry/test_plots.py",
    "telemetry/test_deploy.py::DashboardTest::test_every_metric_used_is_served",
    "telemetry/test_export.py::LiveScrapeTest::test_runtime_series_after_warmup",
    # 3-7 s each in `make test-fast` (--durations=40, 2026-12-03, session 11).
    "serving/test_shrink.py::ShrinkWaitsForLiveDataTest::test_live_growth_past_the_target_waits_and_loses_nothing",
    "serving/test_replicas.py::test_tiny_llama_factory_serves_the_seeded_model_greedily",
    "model/test_layers.py::PagedAttentionLayerTest::test_paged_steps_equal_dense_attention__without_jit",
    "model/test_model_equivalence.py::test_fork_then_both_branches_continue",
    "serving/test_governance.py::QuotaTest::test_cached_blocks_above_the_cached_quota_are_evicted",
    "core/test_transitions.py::TransitionTest::test_allocate_require_contiguous__without_jit",
    "model/test_attention.py::PagedAttentionTest::test_mixed_batch_matches_dense_reference_pallas__without_jit",
    "telemetry/test_deploy.py::AlertRulesTest::test_every_metric_used_is_served",
    # Issue Y's runs of a few seconds each: a mixed-tenant run three times, a child
    # process building pool shapes, the livelock reproductions.
    "serving/test_tenant_blocks.py",
    "test_executables.py",
    "serving/test_progress.py::UnstickTest",
)


# `make test` (the README's test command) leaves out the long tier below and CI runs
# it with a second command (`make test-long`, `.ci/run`): `-m long` and `-m "not long"`
# are complements, so CI runs every test once. The long tier holds the runs that
# repeat, at larger size, a behaviour `make test` already checks (for each family below,
# what stays in `make test` is named), and the multi-process runs. Each took 7-70 s on
# two idle cores (`pytest --durations=0`, 2026-12-03: together about 660 of the
# suite's 1,700 test-seconds). A long test is slow too (`make test-fast` skips it). A test
# module may also mark some of its cases `pytest.mark.long` itself (the Mosaic kernel's
# interpret-mode cases with other dtypes and groups).
_LONG = (
    # 2- and 4-process lockstep runs (their CPU is outside the xdist workers);
    # make test keeps parallel/test_lockstep.py (one process, the same protocol).
    "parallel/test_multiprocess.py",
    # The two largest example runs; make test keeps the other examples' smoke runs.
    "examples/test_examples_smoke.py::test_serve",
    "examples/test_examples_smoke.py::test_fragmentation_study",
    # The soaks (a varied runtime workload read by four tests; the Mooncake trace);
    # make test keeps serving/test_runtime_discipline.py and the scheduler's tests.
    "examples/test_soak_runtime.py",
    "serving/test_soak.py",
    # The server under a misbehaving client load; make test keeps the server's tests.
    "examples/test_soak_server.py",
    # The engine process over a fake engine (a spawn each, ~2 s of imports): failures
    # and bounds; make test keeps the real server over an engine process.
    "serving/test_openai_api.py::test_engine_process_serves_bounds_and_aborts_like_the_thread",
    "serving/test_openai_api.py::test_an_engine_failure_ends_every_request_and_stops_the_process",
    "serving/test_openai_api.py::test_engine_process_start_failures_leave_no_process",
    # gpu_check.sh --dry over every row; make test keeps its subset and plan tests.
    "kernels/test_gpu_check.py::test_dry_mode_every_row_and_injected_faults",
    # Token equality under slot packing and forced compaction; make test keeps it
    # under pressure and preemption (both modes).
    "serving/test_serving_equivalence.py::test_slotted_packing_changes_no_token",
    "serving/test_serving_equivalence.py::test_forced_compaction_and_promotion_change_no_token",
    # Mirror vs device over random operations: make test keeps the first configuration.
    "mirror/test_transitions_match.py::TransitionsMatchTest::test_random_operations1",
    "mirror/test_transitions_match.py::TransitionsMatchTest::test_random_operations2",
    "mirror/test_transitions_match.py::TransitionsMatchTest::test_random_operations3",
    # Random scheduler configs and streams; make test keeps the scheduler's unit tests
    # and the issue-J small-pool sweep.
    "serving/test_scheduler_fuzz.py",
    # Fault injection at every call site: make test keeps the recompute scenario (both
    # shards, most sites); swap, governance and shrink_to sites run here.
    "serving/test_exception_safety.py::FaultInjectionTest::test_every_call_site_swap_shard0",
    "serving/test_exception_safety.py::FaultInjectionTest::test_every_call_site_swap_shard1",
    "serving/test_exception_safety.py::FaultInjectionTest::test_every_call_site_governance_shard0",
    "serving/test_exception_safety.py::FaultInjectionTest::test_every_call_site_governance_shard1",
    "serving/test_exception_safety.py::FaultInjectionTest::test_every_call_site_inside_shrink_to_and_its_steps",
    # The model's shared-prefix generation through the Pallas kernels in interpret mode;
    # make test keeps it with the jnp reference and the kernels' own tests.
    "model/test_model_equivalence.py::test_pallas_kernels_match_dense",
)


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: a whole-system run; `make test-fast` skips it")
  config.addinivalue_line(
      "markers", "long: the long tier; `make test` skips it, `make test-long` (CI) runs it")


def matches(node: str, specs: tuple[str, ...]) -> bool:
  """Whether a test (`path::Class::test[param]`, path relative to tests/) is in `specs`."""
  for spec in specs:
    if spec.endswith("/"):
      if node.startswith(spec):
        return True
    elif node == spec or node.startswith((spec + "::", spec + "[")):
      return True
  return False


def pytest_collection_modifyitems(config, items):
  del config
  import pytest  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.abspath(__file__))
  for item in items:
    rel = os.path.relpath(str(item.path), root).replace(os.sep, "/")
    node = rel + item.nodeid[item.nodeid.index("::"):] if "::" in item.nodeid else rel
    if matches(node, _LONG) or item.get_closest_marker("long"):
      item.add_marker(pytest.mark.long)
      item.add_marker(pytest.mark.slow)
    elif matches(node, _SLOW):
      item.add_marker(pytest.mark.slow)

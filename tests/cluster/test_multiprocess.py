"""Multi-process runs on this host: `jax.distributed` over 127.0.0.1, CPU collectives (gloo).

Each run is `paged_kv.cluster.launch` starting N copies of
`python -m paged_kv.cluster.selfcheck` (one CPU device per process, a global
mesh over all of them, the pool's pages split over kv heads across processes,
`LockstepScheduler` + `ShardedModelExecutor`). The reference is the same
workload in one plain process (`--plain`). Checked:

* 2 and 4 processes: every request's tokens equal the reference's, the K/V
  captured every 2 steps equal it bit for bit (the leader's arrays, every
  process's digests);
* a divergence (an arrival only one process sees) stops every process with
  `ScheduleDiverged`; an exception on one process stops the others with
  `PeerFailed`; a process that dies without a word stops the others (the
  coordination service, at its heartbeat timeout) in bounded time;
* the launcher: a failure or a timeout stops every process, and after every
  launch no process of the run is left (its pids, and any process whose
  environment names the run's coordinator).

Budget: 247 CPU-seconds for this file and test_lockstep.py together (about 2 minutes
on 2 idle cores), most of it compiling the model runs (marked slow);
every launch has a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from paged_kv.cluster import launch
from paged_kv.cluster import selfcheck

# 2- and 4-process lockstep runs (their CPU is outside the xdist workers); `make test` keeps
# parallel/test_lockstep.py (one process, the same protocol).
pytestmark = pytest.mark.long

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_TIMEOUT_S = 420  # one model launch (4 processes: 122 s at load ~15, 265 s at load 35, 2 cores)
FAULT_TIMEOUT_S = 90
HEARTBEAT_S = 5  # the coordination service stops the others this long after a death
STOP_BOUND_S = HEARTBEAT_S + 20  # death -> every process gone (grace 5 s, slack for load)


def _env() -> dict[str, str]:
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
  # One CPU device per process (a forced count would multiply the mesh).
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "force_host_platform_device_count" not in f)
  return env


def _processes_of(coordinator: str) -> list[int]:
  """Pids of live processes whose environment names this run's coordinator."""
  needle = f"{launch.ENV_COORDINATOR}={coordinator}".encode()
  found = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/environ", "rb") as f:
        if needle in f.read().split(b"\0"):
          found.append(int(name))
    except OSError:
      continue
  return found


def _assert_no_orphans(result: launch.LaunchResult) -> None:
  for pid in result.pids:
    assert not os.path.exists(f"/proc/{pid}"), f"process {pid} outlived the launch"
  if sys.platform.startswith("linux"):
    assert _processes_of(result.coordinator) == [], "processes of the run are left"


def _run(out, num_processes: int, *args: str, timeout_s: float = RUN_TIMEOUT_S,
         grace_s: float = 5.0, module: str = "paged_kv.cluster.selfcheck") -> launch.LaunchResult:
  command = [sys.executable, "-m", module, "--out", str(out), *args]
  result = launch.launch(command, num_processes, timeout_s=timeout_s, grace_s=grace_s,
                         env=_env(), cwd=_ROOT)
  _assert_no_orphans(result)
  return result


def _reports(out, num_processes: int) -> list[dict]:
  return [json.load(open(os.path.join(out, f"process_{i}.json"))) for i in range(num_processes)]


def _errors(out, num_processes: int) -> dict[int, dict]:
  got = {}
  for i in range(num_processes):
    path = os.path.join(out, f"process_{i}.error.json")
    if os.path.exists(path):
      got[i] = json.load(open(path))
  return got


def _fail(result: launch.LaunchResult) -> str:
  return result.summary() + "\n" + "\n".join(
      f"--- process {i}\n{t[-3000:]}" for i, t in enumerate(result.tails))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The workload in one plain process (`--plain`: Scheduler + ModelExecutor, one device)."""
  out = tmp_path_factory.mktemp("plain")
  proc = subprocess.run([sys.executable, "-m", "paged_kv.cluster.selfcheck", "--plain",
                         "--out", str(out)], env=_env(), cwd=_ROOT, capture_output=True,
                        text=True, timeout=RUN_TIMEOUT_S, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.load(open(out / "process_0.json"))
  kv = dict(np.load(out / "kv.npz"))
  return report, kv


@pytest.mark.slow
@pytest.mark.parametrize("num_processes", [2, 4])
def test_processes_equal_one_process(reference, tmp_path, num_processes):
  ref, ref_kv = reference
  st = ref["stats"]
  assert st["preemptions"] > 0 and st["evictions"] > 0 and st["hit_tokens"] > 0, st
  assert len(ref["tokens"]) == selfcheck.Workload.num_requests and len(ref_kv) >= 8
  result = _run(tmp_path, num_processes)
  assert result.ok, _fail(result)
  runs = _reports(tmp_path, num_processes)
  kv = dict(np.load(tmp_path / "kv.npz"))
  assert selfcheck.compare(ref, runs, ref_kv, kv) == []
  for run in runs:
    assert run["mesh"] == {"tp": num_processes} and run["devices"] == num_processes
    assert run["local_devices"] == 1
    assert run["page_bytes_local"] * num_processes == run["page_bytes_total"]
    assert run["stats"] == runs[0]["stats"]


@pytest.mark.slow
def test_divergence_is_a_typed_error_on_every_process(tmp_path):
  """An arrival only process 1 sees: every process raises ScheduleDiverged at that step."""
  t0 = time.monotonic()
  result = _run(tmp_path, 2, "--dry", "--kv-every", "0", "--heartbeat", str(HEARTBEAT_S),
                "--timeout", "60", "--fault", "diverge:2:1", timeout_s=FAULT_TIMEOUT_S)
  assert result.returncodes == (selfcheck.EXIT_DIVERGED,) * 2, _fail(result)
  errors = _errors(tmp_path, 2)
  for i in range(2):
    assert errors[i]["type"] == "ScheduleDiverged", errors
    assert "schedule diverged at step 2" in errors[i]["message"], errors
  assert time.monotonic() - t0 < FAULT_TIMEOUT_S


@pytest.mark.slow
def test_exception_on_one_process_stops_the_others(tmp_path):
  result = _run(tmp_path, 2, "--dry", "--kv-every", "0", "--heartbeat", str(HEARTBEAT_S),
                "--timeout", "60", "--fault", "raise:1:1", timeout_s=FAULT_TIMEOUT_S)
  assert result.returncodes == (selfcheck.EXIT_PEER_FAILED, selfcheck.EXIT_ERROR), _fail(result)
  errors = _errors(tmp_path, 2)
  assert errors[0]["type"] == "PeerFailed" and "process 1 failed" in errors[0]["message"]
  assert "injected failure" in errors[0]["message"], errors
  assert result.stop_seconds < STOP_BOUND_S, _fail(result)


@pytest.mark.slow
def test_dead_process_stops_the_others_in_bounded_time(tmp_path):
  """Process 1 exits without a word: the service stops process 0 after its heartbeat."""
  result = _run(tmp_path, 2, "--dry", "--kv-every", "0", "--heartbeat", str(HEARTBEAT_S),
                "--timeout", "60", "--fault", "exit:1:1", timeout_s=FAULT_TIMEOUT_S)
  assert result.returncodes[1] == selfcheck.FAULT_EXIT_STATUS, _fail(result)
  assert result.first_failure == 1 and result.returncodes[0] != 0, _fail(result)
  assert not result.timed_out and result.stop_seconds < STOP_BOUND_S, _fail(result)
  assert ("unhealthy" in result.tails[0] or "PeerFailed" in result.tails[0]
          or "PeerTimeout" in result.tails[0]), _fail(result)


# -- the launcher alone (no JAX in the children: fast) -------------------------------
_CHILD = """
import os, subprocess, sys, time
me = int(os.environ["PAGED_KV_PROCESS_ID"])
mode = sys.argv[1]
if mode == "ok":
  print("process", me, "of", os.environ["PAGED_KV_NUM_PROCESSES"], "at",
        os.environ["PAGED_KV_COORDINATOR"], "hashseed", os.environ["PYTHONHASHSEED"])
  sys.exit(0)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a grandchild
if mode == "fail" and me == 1:
  sys.exit(7)
time.sleep(120)
"""


def _launch_child(mode: str, *, timeout_s: float = 60.0, grace_s: float = 1.0):
  result = launch.launch([sys.executable, "-c", _CHILD, mode], 3, timeout_s=timeout_s,
                         grace_s=grace_s, env=_env(), cwd=_ROOT)
  _assert_no_orphans(result)
  return result


def test_launcher_passes_the_run_to_every_process():
  result = _launch_child("ok")
  assert result.ok and result.status == 0, _fail(result)
  for i, tail in enumerate(result.tails):
    assert f"process {i} of 3 at {result.coordinator} hashseed 0" in tail, tail


def test_launcher_stops_everything_on_a_failure():
  t0 = time.monotonic()
  result = _launch_child("fail", grace_s=1.0)
  assert result.first_failure == 1 and result.status == 7, _fail(result)
  assert result.returncodes[0] < 0 and result.returncodes[2] < 0, result.returncodes  # killed
  assert time.monotonic() - t0 < 20, result.seconds


def test_launcher_timeout_stops_everything():
  result = _launch_child("hang", timeout_s=2.0)
  assert result.timed_out and result.status == launch.TIMEOUT_STATUS, _fail(result)
  assert all(rc < 0 for rc in result.returncodes), result.returncodes
  assert result.seconds < 15, result.seconds


def test_launcher_cli():
  proc = subprocess.run([sys.executable, "-m", "paged_kv.cluster.launch", "-n", "2",
                         "--timeout", "60", "--", sys.executable, "-c", _CHILD, "ok"],
                        env=_env(), cwd=_ROOT, capture_output=True, text=True, timeout=90,
                        check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "[0] process 0 of 2" in proc.stdout and "[1] process 1 of 2" in proc.stdout
  assert "process 1 (pid" in proc.stderr

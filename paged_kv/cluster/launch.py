"""Starts N processes of one command on this host, as a multi-controller JAX run.

Usage:
  python -m paged_kv.cluster.launch -n 2 [--timeout 600] [--grace 10] [--port P] \\
      [--log-dir DIR] -- python -m paged_kv.cluster.selfcheck --out /tmp/run

Every process gets `PAGED_KV_COORDINATOR=127.0.0.1:PORT` (a free port unless
`--port`), `PAGED_KV_NUM_PROCESSES=N`, `PAGED_KV_PROCESS_ID=i`
(`paged_kv.cluster.distributed.initialize()` reads them), `PYTHONHASHSEED=0`
unless set (every process must hash alike) and `PYTHONUNBUFFERED=1`. Its output
is echoed with a `[i]` prefix (and kept in `--log-dir/process_i.log`).

When one process exits non-zero (or on `--timeout`, SIGINT, SIGTERM), the others get
`--grace` seconds to stop, then SIGTERM, then SIGKILL, whole process groups; each
also dies with the launcher (`PR_SET_PDEATHSIG`). Exit status: 0, else the first
failing process's (124 on the timeout); the last summary says why each failed. One
host only: on N hosts, run one process per host with the same variables.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from paged_kv.cluster.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

__all__ = ["LaunchResult", "free_port", "launch", "main"]

TIMEOUT_STATUS = 124
_TAIL_LINES = 60
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class LaunchResult:
  """How a launch ended.

  Attributes:
    returncodes: each process's exit status (negative: killed by that signal).
    stop_seconds: from the first failure to the last exit (0 without failure).
    stopped: the processes the launcher had to signal after the first failure or
      the timeout.
  """

  returncodes: tuple[int, ...]
  pids: tuple[int, ...]
  first_failure: int | None
  timed_out: bool
  seconds: float
  stop_seconds: float
  tails: tuple[str, ...]
  coordinator: str
  stopped: tuple[int, ...] = ()

  @property
  def ok(self) -> bool:
    return not self.timed_out and all(rc == 0 for rc in self.returncodes)

  @property
  def status(self) -> int:
    """The launcher's exit status (see the module docstring)."""
    if self.timed_out:
      return TIMEOUT_STATUS
    if self.first_failure is None:
      return 0
    rc = self.returncodes[self.first_failure]
    return rc if rc > 0 else 128 - rc

  def summary(self) -> str:
    """One line per process: id, pid, exit status, and why it ended (`cause`)."""
    lines = [f"launch: {len(self.pids)} processes, coordinator {self.coordinator}, "
             f"{self.seconds:.1f} s" + (", TIMED OUT" if self.timed_out else "")]
    for i, (pid, rc) in enumerate(zip(self.pids, self.returncodes)):
      mark = "  <- first failure" if i == self.first_failure else ""
      lines.append(f"  process {i} (pid {pid}): exit {rc}{mark}")
      cause = self.cause(i)
      if cause:
        lines.append(f"    {cause}")
    return "\n".join(lines)

  def cause(self, i: int) -> str:
    """Why process `i` ended, in words ("" for a clean exit): the first failure's exit
    and last line; for the others, who stopped them after which peer."""
    rc = self.returncodes[i]
    if rc == 0:
      return ""
    how = _exit_words(rc)
    last = _last_line(self.tails[i])
    said = f"; its last output: {last!r}" if last else ""
    first = self.first_failure
    if self.timed_out and i in self.stopped:
      return f"stopped by the launcher: the run passed its timeout ({how})"
    if first is None or i == first:
      return f"failed first: {how}{said}"
    peer = f"process {first} (pid {self.pids[first]}, {_exit_words(self.returncodes[first])})"
    if i in self.stopped:
      return f"stopped by the launcher ({how}) after {peer} failed"
    if rc in (-signal.SIGABRT, 128 + signal.SIGABRT):
      return (f"aborted ({how}) by JAX's coordination service after {peer} stopped: a "
              f"peer that dies without a word stops its heartbeats{said}")
    return f"ended ({how}) after {peer} failed{said}"


def _exit_words(rc: int) -> str:
  """`rc` in words: "exit status N" or "killed by SIGKILL"."""
  if rc < 0:
    try:
      return f"killed by {signal.Signals(-rc).name}"
    except ValueError:
      return f"killed by signal {-rc}"
  return f"exit status {rc}"


def _last_line(tail: str) -> str:
  lines = [line.strip() for line in tail.splitlines() if line.strip()]
  return lines[-1][:300] if lines else ""


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port free on `host` now (it may be taken before the coordinator binds it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def _die_with_parent() -> None:
  """In the child, before exec: its own session, and SIGKILL when the launcher dies."""
  os.setsid()
  if sys.platform.startswith("linux"):
    try:
      import ctypes  # pylint: disable=g-import-not-at-top
      ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
      pass


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(proc.pid, sig)  # its session's group: the process and its children
  except (ProcessLookupError, PermissionError):
    pass


def _pump(stream, index: int, tail: collections.deque, log, echo) -> None:
  for line in iter(stream.readline, ""):
    tail.append(line)
    if log is not None:
      log.write(line)
      log.flush()
    if echo is not None:
      echo.write(f"[{index}] {line}")
      echo.flush()
  stream.close()


def launch(command: Sequence[str], num_processes: int, *, timeout_s: float = 600.0,
           grace_s: float = 10.0, host: str = "127.0.0.1", port: int | None = None,
           env: dict[str, str] | None = None, cwd: str | None = None,
           log_dir: str | None = None, echo=None) -> LaunchResult:
  """Runs `num_processes` copies of `command` as one multi-controller run and waits.

  Args:
    grace_s: after the first failure, how long the others may take to stop by
      themselves before they are terminated.
    host, port: the coordinator's address (process 0 binds it); default a free port.
    env: the environment (default `os.environ`), to which the run's variables are added.
    echo: a text stream to echo every line to, prefixed `[i] ` (None: quiet).

  Returns:
    The `LaunchResult`; every process has exited and been reaped.

  Raises:
    ValueError: `num_processes < 1` or an empty command.
  """
  if num_processes < 1 or not command:
    raise ValueError(f"launch needs a command and num_processes >= 1, got {list(command)!r}, "
                     f"{num_processes}")
  coordinator = f"{host}:{port or free_port(host)}"
  base = dict(os.environ if env is None else env)
  base.setdefault("PYTHONHASHSEED", "0")
  base["PYTHONUNBUFFERED"] = "1"
  if log_dir is not None:
    os.makedirs(log_dir, exist_ok=True)
  procs: list[subprocess.Popen] = []
  pumps: list[threading.Thread] = []
  tails = [collections.deque(maxlen=_TAIL_LINES) for _ in range(num_processes)]
  logs = []
  t0 = time.monotonic()
  first_failure, failed_at, timed_out = None, None, False
  stopped: tuple[int, ...] = ()
  try:
    for i in range(num_processes):
      child_env = dict(base, **{ENV_COORDINATOR: coordinator,
                                ENV_NUM_PROCESSES: str(num_processes),
                                ENV_PROCESS_ID: str(i)})
      log = (open(os.path.join(log_dir, f"process_{i}.log"), "w", encoding="utf-8")
             if log_dir is not None else None)
      logs.append(log)
      proc = subprocess.Popen(list(command), env=child_env, cwd=cwd, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace", preexec_fn=_die_with_parent)
      procs.append(proc)
      pump = threading.Thread(target=_pump, args=(proc.stdout, i, tails[i], log, echo),
                              daemon=True)
      pump.start()
      pumps.append(pump)
    stop_at = kill_at = None  # when to SIGTERM, then SIGKILL, what is still running
    while any([p.poll() is None for p in procs]):  # a list: poll (reap) every process
      now = time.monotonic()
      if first_failure is None and kill_at is None:  # not one the launcher stopped
        bad = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
        if bad:
          first_failure, failed_at, stop_at = bad[0], now, now + grace_s
      if not timed_out and now - t0 > timeout_s:
        timed_out, stop_at = True, now
        failed_at = now if failed_at is None else failed_at
      if stop_at is not None and now >= stop_at and kill_at is None:
        stopped = tuple(i for i, p in enumerate(procs) if p.poll() is None)
        for p in procs:
          _signal_group(p, signal.SIGTERM)
        kill_at = now + 3.0
      if kill_at is not None and now >= kill_at:
        for p in procs:
          _signal_group(p, signal.SIGKILL)
        kill_at = float("inf")
      time.sleep(0.05)
    if first_failure is None and not timed_out:
      bad = [i for i, p in enumerate(procs) if p.returncode != 0]
      first_failure = bad[0] if bad else None
  finally:
    for p in procs:  # a launcher interrupted (KeyboardInterrupt, SIGTERM) leaves nothing
      if p.poll() is None:
        _signal_group(p, signal.SIGKILL)
    for p in procs:
      p.wait()
      _signal_group(p, signal.SIGKILL)  # grandchildren left in its group
    for t in pumps:
      t.join(timeout=5.0)
    for log in logs:
      if log is not None:
        log.close()
  end = time.monotonic()
  return LaunchResult(returncodes=tuple(p.returncode for p in procs),
                      pids=tuple(p.pid for p in procs), first_failure=first_failure,
                      timed_out=timed_out, seconds=end - t0,
                      stop_seconds=(end - failed_at) if failed_at is not None else 0.0,
                      tails=tuple("".join(t) for t in tails), coordinator=coordinator,
                      stopped=stopped)


def _raise_on_sigterm(signum, frame):  # pylint: disable=unused-argument
  raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m paged_kv.cluster.launch",
      description="Run N processes of a command as one multi-controller JAX run on this host.")
  parser.add_argument("-n", "--num-processes", type=int, required=True)
  parser.add_argument("--timeout", type=float, default=600.0, help="seconds, then stop all")
  parser.add_argument("--grace", type=float, default=10.0,
                      help="seconds the others may take to stop after a failure")
  parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
  parser.add_argument("--log-dir", default=None, help="keep process_<i>.log here")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program args...")
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("no command (put it after --)")
  signal.signal(signal.SIGTERM, _raise_on_sigterm)
  result = launch(command, args.num_processes, timeout_s=args.timeout, grace_s=args.grace,
                  port=args.port, log_dir=args.log_dir, echo=sys.stdout)
  print(result.summary(), file=sys.stderr)
  return result.status


if __name__ == "__main__":
  sys.exit(main())

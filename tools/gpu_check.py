"""The prepared GPU check for one 15-minute lease of an H100/H200.

Usage (from the repository root; `tools/gpu_check.sh` sets PYTHONPATH):
  PYTHONPATH=. python3 tools/gpu_check.py                  # GPU: every row
  PYTHONPATH=. python3 tools/gpu_check.py --dry            # CPU, tiny shapes
  PYTHONPATH=. python3 tools/gpu_check.py --plan           # list rows, limits, estimates
  PYTHONPATH=. python3 tools/gpu_check.py --only=layer/b64x8k,copy/b64x8k

Rows (`tools/gpu_check_rows.py`), cheapest first: correctness of every impl
against a float64 reference at small shapes, then timings in order of bytes
moved: a plain device copy of the same bytes, JAX's built-in paged attention
on the same pages, dense attention on contiguous K/V, the model-facing layer
(`paged_kv.model.attention.paged_attention`, `impl=None` and explicit impls)
at a Llama-3-8B layer's shape (32/8 heads, D128, bf16, block 16) for batch 64
x 8k, batch 1 x 128k and a mixed prefill+decode step, fp8 (e4m3) pages, head
dims 64 and 256, and the block permutation at 32, 256 and 1,024 moves; beside
the fp8 and head_dim 64 rows, `kernel/<shape>/<impl>-pps<n>` rows time the
decode kernel alone for each candidate of `gpu_check_rows.DECODE_VARIANTS`
(impl and ring stage / step width), old and new side by side.
Then the serving rows (`gpu_check_rows.serving_rows`, ids `serving/...`;
`--skip=serving/` leaves them out): a random Llama-3.2-1B-shaped checkpoint
written and loaded, the device's own decode step at batch 64 and 1
(`decode_multi`, 16 steps per call; the note breaks one step down per op with
JAX's profiler), then the overlapped loop and the synchronous
one, each warmed by a row of its own and run at batch 64 and 1 (tokens/s, step
p50/p90, TTFT, TPOT, % of the bandwidth ceiling in `% copy`, step / device step
against the goal, tokens equal between the loops), one 2,048-token prefill chunk
(tokens/s, per-op breakdown), and the served tokens against transformers on the
same checkpoint.

How it runs: this process imports no JAX. One worker process
(`--worker`, JAX and the device there) runs the rows one at a time; each row
has a wall limit, and a row past it (a hung Mosaic kernel, say) has its worker
killed and is recorded as a timeout; the next row gets a fresh worker. A worker
that raised is replaced too (a CUDA error can poison its context). No row
starts unless the remaining budget covers its limit (and a worker start if one
is needed). Rows whose kernel hung or crashed in the correctness tier are
skipped (`needs`). The lowering and compile tiers run in CI on CPU
(tests/kernels/test_lowering.py, tests_compile/): nothing is lowered here.

Output, in `--out_dir` (default `$OUT`, else out/gpu_check): `gpu_check.md`
(header with date, JAX version, device and shapes; the table, a line per row as
it ends; a footer with passed/failed/skipped counts and the goals),
`gpu_check.json` (the same, rewritten after every row) and
`gpu_check_worker.log` (the worker's output, tracebacks included).
Exit status: 0 if no row failed, 1 if one did (timeout, crash, exception or
wrong numbers), 2 if the check could not run at all (no worker, no GPU).

Dry mode (`--dry` or GPU_CHECK_DRY=1): the same rows at tiny shapes on the CPU
(Pallas kernels in interpret mode), for CI to test this script; numbers mean
nothing. GPU_CHECK_INJECT="hang:<row id>,raise:<id>,wrong:<id>,crash:<id>"
injects a fault into a row (tests).
"""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import json
import os
import pathlib
import platform
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from absl import app, flags

import gpu_check_rows as rows_lib  # beside this script (its folder is sys.path[0])

_ROOT = pathlib.Path(__file__).resolve().parents[1]
BUDGET_S = 540.0  # the kernel rows (~85 s on an H200) and the serving rows (~6 min)
DRY_BUDGET_S = 480.0

_DRY = flags.DEFINE_bool("dry", None, "Tiny shapes on the CPU (interpret mode); "
                         "default: $GPU_CHECK_DRY (or $DRY) set to 1.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Output folder; default $OUT, else "
                               "out/gpu_check under the repository.")
_BUDGET = flags.DEFINE_float("budget_s", None, "Wall budget of the whole check: no row "
                             "starts unless what is left covers its limit. Default "
                             "$GPU_CHECK_BUDGET_S, else 540 (dry: 480).")
_ITERS = flags.DEFINE_integer("iters", None, "Calls per timed batch (default 20; dry 1).")
_REPEATS = flags.DEFINE_integer("repeats", None, "Timed batches, median (default 5; dry 1).")
_ONLY = flags.DEFINE_list("only", [], "Run only rows whose id contains one of these "
                          "(or matches it as a glob).")
_SKIP = flags.DEFINE_list("skip", [], "Leave out rows whose id contains one of these.")
_LIMIT = flags.DEFINE_multi_string("limit", [], "ROW_GLOB=SECONDS: override the wall "
                                   "limit of matching rows (repeatable).")
_START_LIMIT = flags.DEFINE_float("start_limit_s", 60, "Wall limit of a worker start "
                                  "(imports + device init; ~10 s seen on CPU).")
_ISOLATE = flags.DEFINE_bool("isolate", False, "A fresh worker for every row.")
_PLAN = flags.DEFINE_bool("plan", False, "Print the rows, their limits and estimates; "
                          "run nothing.")
_WORKER = flags.DEFINE_bool("worker", False, "Internal: be the worker process.")
_PROTO_FD = flags.DEFINE_integer("proto_fd", -1, "Internal: the worker's result pipe.")


# The worker ----------------------------------------------------------------------


def _watch_parent(parent: int):
  """Exit when the driver is gone (killed from outside): no orphan on the GPU."""
  while True:
    time.sleep(1)
    if os.getppid() != parent:
      os._exit(3)


def worker_main(dry: bool, proto_fd: int, parent: int) -> int:
  proto = os.fdopen(proto_fd, "w", buffering=1)
  threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()

  def send(msg):
    proto.write(json.dumps(msg) + "\n")
    proto.flush()

  if dry:
    # Before JAX creates its CPU client: the Mosaic GPU interpreter deadlocks in
    # XLA:CPU pools of one thread per core on a small machine (lowering.py says why).
    from pallas_kernels import lowering
    lowering.reserve_cpu_threads_for_gpu_interpreter()
  import jax  # the device is initialised here, inside the start limit
  import jaxlib
  dev = jax.devices()[0]
  send(dict(type="ready", jax=jax.__version__,
            jaxlib=getattr(jaxlib, "__version__", "?"), backend=jax.default_backend(),
            device_kind=dev.device_kind, platform=dev.platform,
            num_devices=jax.device_count(), python=platform.python_version(),
            pid=os.getpid()))
  specs = {r.id: r for r in rows_lib.plan(dry)}
  for line in sys.stdin:
    req = json.loads(line)
    spec = specs[req["id"]]
    print(f"=== row {spec.id} ({time.strftime('%H:%M:%S')}) ===", file=sys.stderr,
          flush=True)
    t0 = time.monotonic()
    msg = dict(type="result", id=spec.id)
    try:
      res = rows_lib.run_row(spec, dry=dry, iters=req["iters"], repeats=req["repeats"],
                             inject=req.get("inject"))
      msg.update(status="ok", **dataclasses.asdict(res))
    except rows_lib.Skip as e:
      msg.update(status="skip", reason=str(e))
    except rows_lib.Wrong as e:
      msg.update(status="wrong", reason=str(e))
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      first = (str(e).strip().splitlines() or [""])[0]
      msg.update(status="error", reason=f"{type(e).__name__}: {first}")
    msg["wall_s"] = time.monotonic() - t0
    sys.stdout.flush()
    sys.stderr.flush()
    send(msg)
  return 0


# The driver's side of a worker -------------------------------------------------------


class WorkerTimeout(Exception):
  pass


class WorkerDied(Exception):
  pass


class Worker:
  """One worker process: rows in over stdin, results back over a pipe of its
  own (its stdout and stderr go to the log)."""

  def __init__(self, *, dry: bool, log_path: pathlib.Path):
    self.dry = dry
    self.log_path = log_path
    self.proc = None
    self.fd = -1
    self.buf = b""
    self.info = None

  @property
  def alive(self) -> bool:
    return self.proc is not None and self.proc.poll() is None

  def start(self, limit_s: float) -> dict:
    r, w = os.pipe()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if self.dry:
      env["JAX_PLATFORMS"] = "cpu"
    argv = [sys.executable, os.path.abspath(__file__), "--worker", f"--proto_fd={w}",
            f"--dry={'true' if self.dry else 'false'}"]
    with open(self.log_path, "ab") as log:
      self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log,
                                   stderr=subprocess.STDOUT, pass_fds=(w,),
                                   cwd=_ROOT, env=env, start_new_session=True)
    os.close(w)
    self.fd, self.buf = r, b""
    self.info = self._receive(time.monotonic() + limit_s)
    return self.info

  def run(self, row_id: str, limit_s: float, **req) -> dict:
    self.proc.stdin.write((json.dumps(dict(id=row_id, **req)) + "\n").encode())
    self.proc.stdin.flush()
    return self._receive(time.monotonic() + limit_s)

  def _receive(self, deadline: float) -> dict:
    while b"\n" not in self.buf:
      left = deadline - time.monotonic()
      if left <= 0:
        raise WorkerTimeout()
      ready, _, _ = select.select([self.fd], [], [], left)
      if not ready:
        continue
      chunk = os.read(self.fd, 1 << 16)
      if not chunk:
        rc = self.proc.wait()
        raise WorkerDied(f"worker exited ({_exit_text(rc)}): {_log_tail(self.log_path)}")
      self.buf += chunk
    line, self.buf = self.buf.split(b"\n", 1)
    return json.loads(line)

  def kill(self):
    if self.proc is not None:
      if self.proc.poll() is None:
        try:
          os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      self.proc.wait()
      try:
        self.proc.stdin.close()
      except OSError:
        pass
    if self.fd >= 0:
      os.close(self.fd)
    self.proc, self.fd, self.buf = None, -1, b""


def _exit_text(rc: int) -> str:
  if rc < 0:
    try:
      return f"signal {signal.Signals(-rc).name}"
    except ValueError:
      return f"signal {-rc}"
  return f"exit {rc}"


_FATAL = re.compile(r"^(F\d{4} |Fatal Python error)|Check failed|CUDA_ERROR|out of memory",
                    re.IGNORECASE)


def _log_tail(path: pathlib.Path) -> str:
  """Why the worker died, from its log since the last row marker: the first
  fatal-looking line (glog `F0000`, "Fatal Python error", a failed check, a
  CUDA error), else the last line that is not a module list."""
  try:
    text = path.read_text(errors="replace")
  except OSError:
    return ""
  text = text[text.rfind("=== row"):] if "=== row" in text else text
  lines = [x.strip() for x in text.splitlines()[1:] if x.strip()]
  fatal = [x for x in lines if _FATAL.search(x)]
  rest = [x for x in lines if not x.startswith("Extension modules")]
  return (fatal[:1] or rest[-1:] or [""])[0][:240]


# Table ---------------------------------------------------------------------------------

_COLUMNS = ("row", "impl", "shape", "status", "us/call", "GB/s", "% copy", "x builtin",
            "rel err", "goal", "s", "note")


# What the reference rows run (their RowSpec.impl is None, not the library default).
_KIND_IMPL = {"copy": "x + 1 (xla)", "builtin": "jax builtin",
              "dense": "jax.nn.dot_product_attention",
              "serving_checkpoint": "write + load_checkpoint",
              "serving_warmup": "untimed serving pass", "serving_device": "decode_multi k=16",
              "serving_hf": "transformers", "serving_cold_start": "fresh processes"}


def _cell(x) -> str:
  return str(x).replace("|", "/").replace("\n", " ")


@dataclasses.dataclass
class Outcome:
  spec: rows_lib.RowSpec
  status: str  # ok | wrong | error | timeout | crash | skip
  reason: str = ""
  us_per_call: float | None = None
  nbytes: int | None = None
  rel_err: float | None = None
  resolved_impl: str | None = None
  note: str = ""
  wall_s: float | None = None
  limit_s: float | None = None
  gbps: float | None = None
  copy_pct: float | None = None
  x_builtin: float | None = None
  goal: str = ""
  goal_missed: bool = False
  step_us: float | None = None
  x_device: float | None = None

  @property
  def failed(self) -> bool:
    return self.status in ("wrong", "error", "timeout", "crash")


def _status_text(o: Outcome) -> str:
  if o.status == "ok":
    return "ok"
  if o.status == "skip":
    return f"skipped: {o.reason}"
  if o.status == "wrong":
    return f"WRONG: {o.reason}"
  return f"FAILED {o.status}: {o.reason}" if o.reason else f"FAILED {o.status}"


def _fmt(x, spec):
  return "" if x is None else format(x, spec)


def _measure(x):
  """A measured number: one decimal from 10 up, else three significant digits, so a
  small but nonzero rate (a dry run's tiny bytes over a slow CPU) never reads 0.0."""
  if x is None:
    return ""
  return format(x, ".1f") if abs(x) >= 10 else format(x, ".3g")


def table_line(o: Outcome, shape_text: str) -> str:
  impl = _KIND_IMPL.get(o.spec.kind) or o.spec.impl or "default"
  if o.resolved_impl and not o.spec.impl:
    impl = f"default: {o.resolved_impl}"
  cells = (o.spec.id, impl, shape_text, _status_text(o)[:200], _measure(o.us_per_call),
           _measure(o.gbps), _measure(o.copy_pct), _fmt(o.x_builtin, ".2f"),
           _fmt(o.rel_err, ".1e"), o.goal, _fmt(o.wall_s, ".1f"), o.note[:240])
  return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _evaluate(o: Outcome, done: dict):
  """GB/s, % of the same-bytes copy, ratio to JAX's built-in, serving step over the
  device step, the goals."""
  if o.status != "ok" or not o.us_per_call or not o.nbytes:
    return
  o.gbps = o.nbytes / (o.us_per_call * 1e-6) / 1e9
  ref = done.get(o.spec.copy_ref)
  if ref is not None and ref.gbps and o.spec.kind != "copy":
    o.copy_pct = 100 * o.gbps / ref.gbps
  ref = done.get(o.spec.builtin_ref)
  if ref is not None and ref.status == "ok" and ref.us_per_call:
    o.x_builtin = ref.us_per_call / o.us_per_call
  ref = done.get(o.spec.device_ref)
  if ref is not None and ref.status == "ok" and ref.us_per_call and o.step_us:
    o.x_device = o.step_us / ref.us_per_call
    o.note = f"step {o.x_device:.2f}x device; {o.note}"
  if not o.spec.goals:
    return
  parts, missed = [], False
  for name, want in o.spec.goals.items():
    if name == "serving_over_device":
      got, text = o.x_device, f"step <= {want}x device"
    elif name == "copy_pct":
      got, text = o.copy_pct, f">= {want}%"
    else:
      got, text = o.x_builtin, f">= {want}x builtin"
    if got is None:
      parts.append(f"{text}: n/a")
      continue
    ok = got <= want if name == "serving_over_device" else got >= want
    missed |= not ok
    parts.append(f"{text}: {'met' if ok else 'MISSED'}")
  o.goal = "; ".join(parts)
  o.goal_missed = missed


# The driver ----------------------------------------------------------------------------


def _env_flag(*names) -> bool:
  return any(os.environ.get(n, "").strip().lower() in ("1", "true", "yes") for n in names)


def _selected(spec, only, skip) -> bool:
  match = lambda pats: any(p in spec.id or fnmatch.fnmatch(spec.id, p) for p in pats)
  return (not only or match(only)) and not match(skip)


def _limits(specs, overrides, dry):
  out = {}
  for s in specs:
    out[s.id] = s.dry_limit_s if dry else s.limit_s
    for item in overrides:
      pat, _, sec = item.rpartition("=")
      if pat and fnmatch.fnmatch(s.id, pat):
        out[s.id] = float(sec)
  return out


def _injections() -> dict:
  out = {}
  for item in os.environ.get("GPU_CHECK_INJECT", "").split(","):
    kind, _, row = item.strip().partition(":")
    if row:
      out[row] = kind
  return out


def _nvidia_smi() -> str:
  if not shutil.which("nvidia-smi"):
    return ""
  try:
    return subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.memory,driver_version",
         "--format=csv,noheader"], capture_output=True, text=True, timeout=15).stdout.strip()
  except (OSError, subprocess.SubprocessError) as e:
    return f"nvidia-smi failed: {e}"


class Report:
  """The markdown table (appended and flushed per row) and the JSON (rewritten)."""

  def __init__(self, out_dir: pathlib.Path, meta: dict, shapes: dict):
    self.md = out_dir / "gpu_check.md"
    self.js = out_dir / "gpu_check.json"
    self.meta, self.shapes = meta, shapes
    self.rows: list[Outcome] = []
    self.summary: dict = {}

  def _append(self, text: str):
    with open(self.md, "a") as f:
      f.write(text + "\n")
      f.flush()
      os.fsync(f.fileno())
    print(text, flush=True)

  def header(self, extra: dict):
    self.meta.update(extra)
    m = self.meta
    lines = [f"# GPU check, {m['mode']}, {m['date']}", "",
             f"- JAX {m.get('jax', '?')} (jaxlib {m.get('jaxlib', '?')}), Python "
             f"{m.get('python', '?')}; device: {m.get('device_kind', '?')} "
             f"({m.get('platform', '?')}, {m.get('num_devices', '?')} device(s))"]
    if m.get("nvidia_smi"):
      lines.append(f"- nvidia-smi: {m['nvidia_smi']}")
    lines += [f"- command: `{m['command']}`",
              f"- budget {m['budget_s']:.0f} s; {m['iters']} calls x {m['repeats']} "
              "batches per timing (median); `% copy` = GB/s against a plain device copy "
              "moving the same bytes (read + written); attention bytes = whole blocks "
              "touched (K + V); `x builtin` = JAX's built-in time / this row's time",
              "", "Shapes:", ""]
    lines += [f"- `{k}`: {s.describe()}" for k, s in self.shapes.items()]
    lines += ["", "| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    with open(self.md, "w") as f:
      f.write("")
    self._append("\n".join(lines))
    self._write_json()

  def row(self, o: Outcome):
    self.rows.append(o)
    self._append(table_line(o, o.spec.key))
    self._write_json()

  def footer(self, wall_s: float, budget_s: float, aborted: str = ""):
    n = len(self.rows)
    passed = sum(o.status == "ok" for o in self.rows)
    failed = [o for o in self.rows if o.failed]
    skipped = sum(o.status == "skip" for o in self.rows)
    timeouts = sum(o.status == "timeout" for o in self.rows)
    goals = [o for o in self.rows if o.goal]
    missed = [o.spec.id for o in goals if o.goal_missed]
    self.summary = dict(rows=n, passed=passed, failed=len(failed), skipped=skipped,
                        timeouts=timeouts, failed_rows=[o.spec.id for o in failed],
                        goals_evaluated=len(goals), goals_missed=missed,
                        wall_s=wall_s, budget_s=budget_s, aborted=aborted)
    text = [""]
    if aborted:
      text.append(f"ABORTED: {aborted}")
    text.append(f"{n} rows: {passed} passed, {len(failed)} failed ({timeouts} timed out), "
                f"{skipped} skipped; {wall_s:.0f} s of a {budget_s:.0f} s budget")
    if failed:
      text.append("failed: " + ", ".join(o.spec.id for o in failed))
    if goals:
      dry = " (dry mode: meaningless)" if self.meta.get("dry") else ""
      text.append(f"goals (issues 22, T){dry}: {len(goals) - len(missed)} of {len(goals)} rows "
                  "met theirs" + (f"; missed: {', '.join(missed)}" if missed else ""))
    self._append("\n".join(text))
    self._write_json()

  def _write_json(self):
    data = dict(self.meta, shapes={k: dict(dataclasses.asdict(s), describe=s.describe(),
                                           nbytes=s.nbytes)
                                   for k, s in self.shapes.items()},
                rows=[_outcome_json(o) for o in self.rows], summary=self.summary)
    tmp = self.js.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, self.js)


def _outcome_json(o: Outcome) -> dict:
  d = {k: v for k, v in dataclasses.asdict(o).items() if k != "spec"}
  d.update(id=o.spec.id, kind=o.spec.kind, impl=o.spec.impl, shape_key=o.spec.key,
           copy_ref=o.spec.copy_ref, builtin_ref=o.spec.builtin_ref,
           device_ref=o.spec.device_ref, goals=o.spec.goals)
  return d


class _Terminated(Exception):
  pass


def _on_signal(signum, frame):
  del frame
  raise _Terminated(signal.Signals(signum).name)


def driver_main(dry: bool) -> int:
  t_start = time.monotonic()
  out_dir = pathlib.Path(_OUT_DIR.value or os.environ.get("OUT") or _ROOT / "out" / "gpu_check")
  out_dir.mkdir(parents=True, exist_ok=True)
  budget = _BUDGET.value or float(os.environ.get("GPU_CHECK_BUDGET_S") or 0) or (
      DRY_BUDGET_S if dry else BUDGET_S)
  iters = _ITERS.value or (1 if dry else 20)
  repeats = _REPEATS.value or (1 if dry else 5)
  start_limit = _START_LIMIT.value
  specs = [s for s in rows_lib.plan(dry) if _selected(s, _ONLY.value, _SKIP.value)]
  limits = _limits(specs, _LIMIT.value, dry)
  shapes = rows_lib.shapes(dry)
  if _PLAN.value:
    total_est = sum(s.est_s for s in specs)
    print(f"{len(specs)} rows; limits sum {sum(limits.values()):.0f} s; estimate "
          f"{total_est:.0f} s on an H200 (+ ~10 s per worker start); budget {budget:.0f} s")
    for s in specs:
      print(f"  {s.id:28s} limit {limits[s.id]:5.0f} s  est {s.est_s:4.0f} s  "
            f"{shapes[s.key].describe()}")
    return 0
  injections = _injections()
  log_path = out_dir / "gpu_check_worker.log"
  log_path.write_text("")
  report = Report(out_dir, dict(
      date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
      mode="dry mode (CPU, tiny shapes, interpret mode; numbers mean nothing)" if dry
      else "full run", dry=dry, command=" ".join(sys.argv), budget_s=budget, iters=iters,
      repeats=repeats, limits=limits, nvidia_smi="" if dry else _nvidia_smi()), shapes)
  serving_dir = None
  if dry:  # the serving rows' checkpoint: this run's own, removed at its end
    serving_dir = tempfile.mkdtemp(prefix="paged_kv_gpu_check_")
    os.environ[rows_lib.SERVING_DIR_ENV] = serving_dir
  worker = Worker(dry=dry, log_path=log_path)
  done: dict[str, Outcome] = {}
  aborted = ""
  header_written = False
  start_failures = 0
  old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    for spec in specs:
      limit = limits[spec.id]
      left = budget - (time.monotonic() - t_start)
      need = limit + (0 if worker.alive else start_limit)
      outcome = None
      hung = [n for n in spec.needs if n in done and done[n].status in ("timeout", "crash")]
      if aborted:
        outcome = Outcome(spec, "skip", aborted, limit_s=limit)
      elif hung:
        outcome = Outcome(spec, "skip", f"needs {hung[0]} ({done[hung[0]].status})",
                          limit_s=limit)
      elif left < need:
        outcome = Outcome(spec, "skip", f"budget: {left:.0f} s left < {need:.0f} s "
                          f"(limit{'' if worker.alive else ' + worker start'})",
                          limit_s=limit)
      if outcome is None and not worker.alive:
        try:
          info = worker.start(start_limit)
          start_failures = 0
          if not header_written:
            report.header({k: info.get(k) for k in ("jax", "jaxlib", "python", "backend",
                                                     "device_kind", "platform",
                                                     "num_devices")})
            header_written = True
          if not dry and info.get("backend") not in ("gpu", "cuda", "rocm"):
            aborted = (f"no GPU: JAX's backend is {info.get('backend')!r} (use --dry "
                       "for a CPU run)")
            outcome = Outcome(spec, "skip", aborted, limit_s=limit)
        except (WorkerTimeout, WorkerDied) as e:
          worker.kill()
          start_failures += 1
          why = (f"worker start timed out after {start_limit:.0f} s"
                 if isinstance(e, WorkerTimeout) else str(e))
          if start_failures >= 2:
            aborted = f"the worker cannot start: {why}"
          outcome = Outcome(spec, "crash", why, limit_s=limit)
      if outcome is None:
        t0 = time.monotonic()
        try:
          msg = worker.run(spec.id, limit, iters=iters, repeats=repeats,
                           inject=injections.get(spec.id))
          fields = {k: msg.get(k) for k in ("reason", "us_per_call", "nbytes", "rel_err",
                                            "resolved_impl", "step_us")}
          outcome = Outcome(spec, msg["status"], **{k: v for k, v in fields.items()
                                                     if v is not None},
                            note=msg.get("note") or "", wall_s=time.monotonic() - t0,
                            limit_s=limit)
          if outcome.failed or _ISOLATE.value:
            worker.kill()  # a failed row may leave the device in a bad state
        except WorkerTimeout:
          worker.kill()
          outcome = Outcome(spec, "timeout", f"no result within its {limit:.0f} s limit "
                            "(worker killed)", wall_s=time.monotonic() - t0, limit_s=limit)
        except WorkerDied as e:
          worker.kill()
          outcome = Outcome(spec, "crash", str(e), wall_s=time.monotonic() - t0,
                            limit_s=limit)
      if not header_written:
        report.header({})
        header_written = True
      _evaluate(outcome, done)
      done[spec.id] = outcome
      report.row(outcome)
  except _Terminated as e:
    aborted = f"interrupted by {e}"
  finally:
    worker.kill()
    if serving_dir is not None:
      shutil.rmtree(serving_dir, ignore_errors=True)
    for s, h in old.items():
      signal.signal(s, h)
  if not header_written:
    report.header({})
  report.footer(time.monotonic() - t_start, budget, aborted)
  if aborted and not any(o.status == "ok" for o in report.rows):
    return 2
  return 1 if report.summary["failed"] or aborted else 0


def main(argv):
  del argv
  dry = _DRY.value if _DRY.value is not None else _env_flag("GPU_CHECK_DRY", "DRY")
  if _WORKER.value:
    return worker_main(dry, _PROTO_FD.value, os.getppid())
  return driver_main(dry)


if __name__ == "__main__":
  app.run(main)

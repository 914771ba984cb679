"""Host time the `Engine` (the facade's and the server's core) adds around a scheduler step.

The chat workload of `bench_scheduler` (`workload.ChatShape.host_benchmark`: a shared
system prompt, random suffixes and output lengths, a finished request replaced at once)
through `Engine.add` / `Engine.step` over `Scheduler` + `DryExecutor` (no model math),
with a byte-level BPE tokenizer (`random_checkpoint.write_byte_level_tokenizer`) and
`--batch` requests always live. Per mode, measured in the same run on the same workload:

  * `stream`: every request streamed (a chunk per request per step, its text decoded
    incrementally: what a streaming server does);
  * `final`: `Engine.add(final_only=True)` (one chunk per request, when it finishes, its
    text decoded once: what `LLM.generate` and a non-streamed response do);
  * `ids`: streamed chunks of token ids, no tokenizer (`detokenize=False`: what the
    engine process does, its front decoding the text).

It reports the median `Engine.step` wall, the median of the `Scheduler.step` inside it,
and the engine's own part (their difference, per step, then the median), and with
`--exporter` the median of a `MetricsExporter.observe` of each step's report (timed
directly; the exporter the server attaches). On CPU the executor's device work runs on
the host too; the engine's own part is host work everywhere.

Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/bench_engine.py                      # batch 64, 256
  PYTHONPATH=. .venv/bin/python benchmarks/bench_engine.py --batch=256 --repeats=5 --record=docs/records/engine/
"""

from __future__ import annotations

import statistics
import tempfile
import time

from absl import app, flags

from benchmarks import records, shared_flags
import paged_kv
from paged_kv.model import random_checkpoint
from paged_kv.model.tokenizer import Tokenizer
from paged_kv.scheduler.executor import DryExecutor
from paged_kv.entrypoints.llm import Engine
from paged_kv.scheduler.scheduler import Scheduler, SchedulerConfig
from paged_kv.sim import workload

_BATCH = flags.DEFINE_list("batch", ["64", "256"], "Live requests per step.")
_MODES = flags.DEFINE_list("modes", ["stream", "final", "ids"], "Engine modes (see above).")
_STEPS = flags.DEFINE_integer("steps", 200, "Timed steps per configuration.")
_WARMUP = flags.DEFINE_integer("warmup", 60, "Untimed steps first (compilation).")
_REPEATS = shared_flags.define_repeats(3, "Rounds (median of medians).")
_VOCAB = flags.DEFINE_integer("vocab", 2000, "Tokenizer vocabulary (trained BPE).")
_SEED = shared_flags.define_seed("Workload seed.")
_EXPORTER = flags.DEFINE_bool("exporter", True, "Also time MetricsExporter.observe per step "
                              "(needs prometheus-client).")
_RECORD = shared_flags.define_record()

BLOCK_SIZE = 16


def _engine(batch: int, tokenizer: Tokenizer | None) -> Engine:
  config = paged_kv.PoolConfig(num_blocks=4096, block_size=BLOCK_SIZE, num_layers=1,
                               num_kv_heads=1, head_dim=2, dtype="bfloat16",
                               max_seqs=batch, max_segments=64)
  sched = Scheduler(paged_kv.BlockPool(config), DryExecutor(config),
                    SchedulerConfig(max_batch=batch, prefill_token_budget=8 * BLOCK_SIZE * 4,
                                    prefill_chunk=BLOCK_SIZE * 4, compaction=None,
                                    output_reserve_ratio=0.0, stats_every=1,
                                    snapshot_every=100))
  return Engine(sched, tokenizer, max_seq_len=4096, vocab_size=_VOCAB.value)


def _run(batch: int, mode: str, tokenizer: Tokenizer, seed: int, exporter_cls
         ) -> tuple[float, float, float, float | None]:
  """Median ms of (Engine.step, Scheduler.step inside it, their difference, observe)."""
  engine = _engine(batch, None if mode == "ids" else tokenizer)
  sched = engine.scheduler
  chat = workload.ChatWorkload(workload.ChatShape.host_benchmark(
      BLOCK_SIZE, vocab=(workload.FIRST_TOKEN_ID, _VOCAB.value)), seed)

  def top_up() -> None:
    while engine.num_live < batch:
      prompt, max_tokens, _ = chat.draw()
      engine.add(prompt.tolist(), max_tokens=max_tokens, final_only=mode == "final")

  inner: list[float] = []
  step = sched.step

  def timed_step() -> None:
    t0 = time.perf_counter()
    step()
    inner.append(time.perf_counter() - t0)

  sched.step = timed_step
  reports: list = []
  previous = sched.on_step

  def keep(report) -> None:
    previous(report)
    reports.append(report)

  sched.on_step = keep
  sched.warmup(progress=False)
  for _ in range(_WARMUP.value):
    top_up()
    engine.step()
  inner.clear()
  reports.clear()
  outer = []
  for _ in range(_STEPS.value):
    top_up()
    t0 = time.perf_counter()
    engine.step()
    outer.append(time.perf_counter() - t0)
  own = [a - b for a, b in zip(outer, inner)]
  observe = None
  if exporter_cls is not None:
    exporter = exporter_cls()
    times = []
    for report in reports:
      t0 = time.perf_counter()
      exporter.observe(report)
      times.append(time.perf_counter() - t0)
    observe = 1e3 * statistics.median(times)
  return (1e3 * statistics.median(outer), 1e3 * statistics.median(inner),
          1e3 * statistics.median(own), observe)


def main(argv):
  del argv
  rec = records.Recorder(_RECORD.value, "bench_engine", flag_values=records.script_flags(),
                         seeds=[_SEED.value + r for r in range(_REPEATS.value)])
  exporter_cls = None
  if _EXPORTER.value:
    try:
      from paged_kv.telemetry.export import MetricsExporter  # pylint: disable=import-outside-toplevel
      MetricsExporter()
      exporter_cls = MetricsExporter
    except ImportError as err:
      print(f"--exporter: skipped ({err})")
  with tempfile.TemporaryDirectory() as tmp:
    tokenizer = Tokenizer.from_file(
        random_checkpoint.write_byte_level_tokenizer(tmp, _VOCAB.value))
  rows = []
  for batch in (int(b) for b in _BATCH.value):
    results: dict[str, list] = {m: [] for m in _MODES.value}
    for r in range(_REPEATS.value):
      order = _MODES.value if r % 2 == 0 else _MODES.value[::-1]
      for mode in order:
        results[mode].append(_run(batch, mode, tokenizer, _SEED.value + r, exporter_cls))
        print(f"round {r} batch {batch:4d} {mode:6s}: engine {results[mode][-1][0]:.3f} ms, "
              f"scheduler {results[mode][-1][1]:.3f} ms, own {results[mode][-1][2]:.3f} ms",
              flush=True)
    for mode, runs in results.items():
      med = [statistics.median(col) if None not in col else None for col in zip(*runs)]
      rows.append(dict(batch=batch, mode=mode, engine_ms=med[0], scheduler_ms=med[1],
                       own_ms=med[2], observe_ms=med[3]))
  print("\nHost ms per step (median of rounds' medians; DryExecutor, byte-level BPE of "
        f"{_VOCAB.value} ids). 'own': Engine.step minus the Scheduler.step inside it; "
        "'observe': MetricsExporter.observe of the step's report")
  print(f"{'batch':>5} {'mode':>6} {'engine':>8} {'scheduler':>9} {'own':>7} {'observe':>8}")
  for row in rows:
    observe = "-" if row["observe_ms"] is None else f"{row['observe_ms']:.3f}"
    print(f"{row['batch']:5d} {row['mode']:>6} {row['engine_ms']:8.3f} "
          f"{row['scheduler_ms']:9.3f} {row['own_ms']:7.3f} {observe:>8}")
  rec.write({"steps": _STEPS.value, "warmup": _WARMUP.value, "repeats": _REPEATS.value,
             "rows": rows})


if __name__ == "__main__":
  app.run(main)

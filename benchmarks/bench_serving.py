"""Serving benchmark: a Llama-shaped Hugging Face checkpoint through `Scheduler` + `ModelExecutor`.

The model: `--shape` writes a random checkpoint with a real model's shape
(`llama-3.2-1b`, `llama-3.1-8b`, or `tiny`; `paged_kv.model.random_checkpoint`:
config.json and safetensors under transformers' names, bf16 on a GPU) into
`--checkpoint_dir` or a temporary directory; `--checkpoint DIR` reads an existing
one instead. Either is loaded with `hf_checkpoint.load_checkpoint`.

The workload: random prompts (`--prompt_len`, `--output_len`, `--num_requests`,
`--seed`; ids uniform in [3, vocab)) or a request trace (`--trace`, Mooncake or
Azure, `paged_kv.sim.traces`; lengths divided by `--trace_scale` and capped
at `--prompt_len` / `--output_len`; arrival times unused). No stop token: every
request generates its full output length.

The sweep: for each `--batch` B, B requests are kept in flight (a finished one is
replaced by the next; vLLM's `--max-concurrency`). ONE program set serves the whole
sweep: the scheduler's `max_batch` is the largest B and smaller B only run fewer
rows, so nothing recompiles between batches. `--warmup=full` compiles the set once
with `Scheduler.warmup()` before the first row; `--warmup=serve` serves each row's
workload shape once untimed (other prompts of the same lengths), which compiles only
the programs the rows run (fewer at a large `max_batch`). Each batch row gets prompts
of its own (no prefix-cache hits from an earlier row) and an untimed run of B short
requests first. For each loop in `--overlap` (the synchronous loop, the overlapped
one, or both, each with its own scheduler and pool over one shared executor) and
`--decode_steps` (`SchedulerConfig.overlap`, `decode_steps`), the same rows run;
`--repeats` rounds (prompts of their own, the loops' order alternating) give each row
its median round by tokens/s.

Figures per (batch, loop) row: output tokens/s (output tokens / the run's wall
time), TTFT and TPOT p50/p99 (per request, on the scheduler's clock; TPOT = (last -
first token) / (tokens - 1)), scheduler step wall p50/p90, compiles during the run
(0 after the warm-up), and **% of the bandwidth ceiling**: one decode step must
read the weights (all but an untied input embedding) and the K/V of B sequences at
the run's mean context (prompt + half the output); at the copy rate measured in this
run on this device (a timed `x + 1` over `--copy_mib` of bf16, read + written), that
takes `bytes / rate`, a ceiling of B tokens per that time. On a CPU the ceiling is
only indicative (the "device" is this CPU and its caches). `--device_step` adds the
device's own decode step for the same batch (`PagedRunner.decode`, 16 steps per
jitted call) and the ratio serving step / device step.

With torch and transformers installed, the first `--hf_requests` requests of every
batch row also go through transformers (same checkpoint, its stored dtype;
`paged_kv.model.hf_reference`): `= HF` counts the requests whose greedy tokens equal
transformers' `generate` in full, `argmax` the tokens that are transformers' argmax
given our own sequence (teacher-forced, near-ties within `--hf_tie_tolerance`
standard deviations allowed: in bf16 two implementations round a near-tie apart and
free-running generations then part, so `= HF` alone under-counts agreement).
Without them it prints why it skipped. The loops' tokens are compared with each
other too (they must be equal).

Usage:
  PYTHONPATH=. .venv/bin/python benchmarks/bench_serving.py                       # GPU: 1B; CPU: tiny
  PYTHONPATH=. python benchmarks/bench_serving.py --shape=llama-3.2-1b --batch=1,16,64,256
  PYTHONPATH=. python benchmarks/bench_serving.py --checkpoint=/models/Llama-3.2-1B --batch=64
  PYTHONPATH=. .venv/bin/python benchmarks/bench_serving.py --shape=tiny --batch=1,4 --prompt_len=32 \
      --output_len=16 --prefill_token_budget=64 --record=docs/records/serving/
"""

from __future__ import annotations

import os

# transformers shares the GPU in the comparison: JAX takes memory as it needs it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# pylint: disable=wrong-import-position
import pathlib
import shutil
import tempfile
import time

import jax
from absl import app, flags

from benchmarks import records, shared_flags
from paged_kv.model import hf_checkpoint, hf_reference, random_checkpoint
from paged_kv.runtime import counters
from paged_kv.sim import serving_bench as sb
from paged_kv.sim.workload import Workload, random_workload, shadow_workload, trace_workload
from paged_kv.scheduler.executor import ModelExecutor
from paged_kv.scheduler.scheduler import SchedulerConfig
# pylint: enable=wrong-import-position

_SHAPE = flags.DEFINE_enum("shape", None, list(random_checkpoint.SHAPES),
                           "Write a random checkpoint of this shape (default: llama-3.2-1b on "
                           "a GPU, tiny on a CPU).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Read this Hugging Face checkpoint "
                                  "directory instead of writing a random one.")
_CHECKPOINT_DIR = flags.DEFINE_string("checkpoint_dir", None, "Where to write the random "
                                      "checkpoint (kept); default: a temporary directory.")
_DTYPE = flags.DEFINE_enum("dtype", None, ["bfloat16", "float16", "float32"],
                           "The model's dtype (default: bfloat16 on a GPU, float32 on a CPU; "
                           "with --checkpoint, its own).")
_SEED = shared_flags.define_seed("Weights and prompts seed.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 512, "Prompt tokens (a trace: the cap).")
_OUTPUT_LEN = flags.DEFINE_integer("output_len", 128, "Output tokens (a trace: the cap).")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 0, "Requests per batch row (0: 2 x "
                                     "batch, at least 4).")
_TRACE = flags.DEFINE_string("trace", None, "A Mooncake .jsonl or Azure .csv trace "
                             "(../shared/traces/ beside the repository) instead of random "
                             "prompts.")
_TRACE_SCALE = flags.DEFINE_integer("trace_scale", 1, "Divide the trace's lengths by this.")
_BATCH = flags.DEFINE_list("batch", ["1", "16", "64", "256"], "Concurrent requests, one "
                           "row each.")
_OVERLAP = flags.DEFINE_enum("overlap", "both", ["sync", "overlapped", "both"],
                             "The loop(s): SchedulerConfig.overlap False, True, or both "
                             "(measured in the same run).")
_DECODE_STEPS = flags.DEFINE_integer("decode_steps", 1, "SchedulerConfig.decode_steps: "
                                     "decode steps one dispatch may run.")
_BLOCK_SIZE = shared_flags.define_block_size()
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 0, "Pool blocks (0: twice what the "
                                   "largest batch holds).")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 512, "Prompt tokens per sequence "
                                      "per step.")
_PREFILL_BUDGET = flags.DEFINE_integer("prefill_token_budget", 2048, "Prompt tokens per step.")
_IMPL = flags.DEFINE_enum("impl", None, ["xla", "pallas", "mosaic"],
                          "Attention path (default: paged_kv.model.default_impl).")
_WARMUP = flags.DEFINE_enum("warmup", "full", ["full", "serve"], "full: Scheduler.warmup() "
                            "(every program of the config); serve: an untimed pass of each "
                            "row's workload shape before its first round.")
_REPEATS = shared_flags.define_repeats(1, "Rounds over every (batch, loop), each with "
                                       "prompts of its own and the loops in turn first; the "
                                       "table shows each row's median round by tokens/s.")
_DEVICE_STEP = flags.DEFINE_bool("device_step", False, "Also time the device's own decode "
                                 "step per batch (PagedRunner, 16 steps per call; compiles "
                                 "two programs per batch).")
_HF_COMPARE = flags.DEFINE_bool("hf_compare", True, "Compare greedy tokens with "
                                "transformers when torch and transformers are installed.")
_HF_REQUESTS = flags.DEFINE_integer("hf_requests", 16, "Requests per batch row compared "
                                    "(0: all).")
_HF_TIE = flags.DEFINE_float("hf_tie_tolerance", 0.1, "Teacher-forced check: a token whose "
                              "logit is within this many standard deviations of "
                              "transformers' best counts as its argmax (a near-tie).")
_HF_BATCH = flags.DEFINE_integer("hf_batch", 64, "Requests per transformers generate call.")
_COPY_MIB = flags.DEFINE_integer("copy_mib", 0, "MiB the copy-rate timing moves (0: 2048 "
                                 "on a GPU, 128 on a CPU).")
_RECORD = shared_flags.define_record()
_COMPILE_CACHE = shared_flags.define_compile_cache()

LOOPS = {"sync": False, "overlapped": True}


def _workloads(batches: list[int], vocab: int) -> dict[tuple[int, int], Workload]:
  """{(batch, round): workload}, no two sharing a prompt (a trace: disjoint slices)."""
  out, skip = {}, 0
  for r in range(_REPEATS.value):
    for i, b in enumerate(batches):
      n = _NUM_REQUESTS.value or max(2 * b, 4)
      if _TRACE.value:
        out[b, r] = trace_workload(_TRACE.value, n, vocab, skip=skip,
                                      scale=_TRACE_SCALE.value,
                                      max_prompt_len=_PROMPT_LEN.value,
                                      max_output_len=_OUTPUT_LEN.value)
        skip += n
      else:
        out[b, r] = random_workload(n, _PROMPT_LEN.value, _OUTPUT_LEN.value, vocab,
                                       seed=_SEED.value + 1 + i + 1000 * r)
  return out


def _checkpoint(on_gpu: bool) -> tuple[pathlib.Path, str, float, str | None]:
  """(directory, what it is, seconds spent writing it, a temp dir to remove or None)."""
  if _CHECKPOINT.value:
    return pathlib.Path(_CHECKPOINT.value), f"checkpoint {_CHECKPOINT.value}", 0.0, None
  shape = _SHAPE.value or ("llama-3.2-1b" if on_gpu else "tiny")
  dtype = _DTYPE.value or ("bfloat16" if on_gpu else "float32")
  tmp = None if _CHECKPOINT_DIR.value else tempfile.mkdtemp(prefix=f"paged_kv_{shape}_")
  path = pathlib.Path(_CHECKPOINT_DIR.value or tmp)
  hf = random_checkpoint.hf_config(shape, dtype=dtype)
  print(f"writing a random {shape} checkpoint ({random_checkpoint.num_parameters(hf):,} "
        f"parameters, {dtype}) to {path} ...", flush=True)
  t0 = time.perf_counter()
  random_checkpoint.write_random_checkpoint(path, hf, seed=_SEED.value)
  return path, f"random {shape} ({dtype})", time.perf_counter() - t0, tmp


def _hf_compare(path, workloads: dict[int, Workload], runs: list[dict]) -> str:
  """Adds transformers' verdicts to `runs` (their first `--hf_requests` requests);
  returns the line that says what ran."""
  if not _HF_COMPARE.value:
    return "transformers comparison off (--nohf_compare)."
  why = hf_reference.available()
  if why:
    return f"transformers comparison skipped: {why}."
  n = _HF_REQUESTS.value or None
  print("transformers: loading the checkpoint ...", flush=True)
  ref = hf_reference.Reference(path)
  print("transformers: generate and teacher-forced check ...", flush=True)
  verdicts, rate = sb.compare_with_reference(
      ref, {b: w.prompts for b, w in workloads.items()},
      {b: w.output_lens for b, w in workloads.items()},
      {(x["batch"], x["loop"]): x["outputs"][:n] for x in runs},
      tie_tolerance=_HF_TIE.value, batch_size=_HF_BATCH.value)
  ref.close()
  for x in runs:
    x["hf"] = verdicts[x["batch"], x["loop"]]
  return (f"transformers {ref.version} ({ref.device}, {ref.dtype}): generate {rate:,.0f} "
          f"tokens/s; '= HF': requests whose greedy tokens all equal transformers' "
          f"generate; 'argmax': our tokens that are transformers' argmax given our "
          f"sequence (teacher-forced, ties within {_HF_TIE.value:g} std of the position's "
          f"logits allowed).")


def _serve_warmup(sched, workload: Workload, batch: int, first_id: int, warm: dict):
  """`--warmup=serve`: serves `workload` untimed; adds its compiles and time to `warm`."""
  compiles, loads, t0 = counters.backend_compiles(), counters.cache_loads(), time.perf_counter()
  sb.run_closed_loop(sched, workload, batch, first_id=first_id)
  warm.update(requests=warm["requests"] + len(workload),
              compiles=warm["compiles"] + counters.backend_compiles() - compiles,
              cache_loads=warm["cache_loads"] + counters.cache_loads() - loads,
              seconds=warm["seconds"] + time.perf_counter() - t0)


def main(argv):
  del argv
  _COMPILE_CACHE.enable()
  batches = sorted({int(b) for b in _BATCH.value})
  if min(batches) < 1:
    raise app.UsageError("--batch values must be >= 1")
  loops = list(LOOPS) if _OVERLAP.value == "both" else [_OVERLAP.value]
  backend = jax.default_backend()
  on_gpu = backend in ("gpu", "cuda", "rocm")
  rec = records.Recorder(_RECORD.value, "bench_serving", flag_values=records.script_flags(),
                         seeds=[_SEED.value])
  path, what, write_s, tmp = _checkpoint(on_gpu)
  try:
    vocab = hf_checkpoint.llama_config_from_hf(hf_checkpoint.read_hf_config(path),
                                               max_seq_len=1)[0].vocab_size
    workloads = _workloads(batches, vocab)
    max_len = max(w.max_seq_len for w in workloads.values())
    t0 = time.perf_counter()
    ckpt = hf_checkpoint.load_checkpoint(path, dtype=_DTYPE.value if _CHECKPOINT.value else None,
                                         max_seq_len=max_len)
    load_s = time.perf_counter() - t0
    cfg = ckpt.config
    pool_config = sb.serving_pool_config(cfg, max_batch=max(batches), max_seq_len=max_len,
                                         block_size=_BLOCK_SIZE.value,
                                         num_blocks=_NUM_BLOCKS.value)
    executor = ModelExecutor(ckpt.model, pool_config, impl=_IMPL.value)
    scheds, warm = {}, {}
    for loop in loops:
      sched_config = SchedulerConfig(
          max_batch=max(batches), prefill_chunk=_PREFILL_CHUNK.value,
          prefill_token_budget=max(_PREFILL_BUDGET.value, _PREFILL_CHUNK.value),
          compaction=None, overlap=LOOPS[loop], decode_steps=_DECODE_STEPS.value,
          max_seq_len=max_len)
      scheds[loop] = sb.build_scheduler(executor, pool_config, sched_config)
      if _WARMUP.value == "full":
        print(f"warm-up ({loop}) ...", flush=True)
        w = scheds[loop].warmup(progress=False, persistence=False)
        warm[loop] = dict(mode="full", programs=w.programs, compiles=w.compiles,
                          cache_loads=w.cache_loads, seconds=w.seconds)
        print(f"  {w}", flush=True)
      else:
        warm[loop] = dict(mode="serve", requests=0, compiles=0, cache_loads=0, seconds=0.0)
    copy_bytes = (_COPY_MIB.value or (2048 if on_gpu else 128)) << 20
    rate = sb.copy_rate(copy_bytes)
    weight_bytes = sb.weight_bytes_per_step(ckpt.model)
    kv_token = sb.kv_bytes_per_token(pool_config)
    runs: dict[tuple[int, str], list[dict]] = {}
    next_id = {loop: 0 for loop in loops}
    device_s = {}
    for r in range(_REPEATS.value):
      for b in batches:
        wl = workloads[b, r]
        eff = min(b, len(wl))
        if _DEVICE_STEP.value and r == 0:
          device_s[b] = sb.device_step_seconds(
              ckpt.model, wl.prompts[:eff], block_size=_BLOCK_SIZE.value,
              prefill_chunk=min(_PREFILL_CHUNK.value, max(len(p) for p in wl.prompts)),
              impl=_IMPL.value)
        warm_wl = random_workload(eff, _PROMPT_LEN.value, 4, vocab,
                                     seed=_SEED.value + 100_000 + 1000 * r + b)
        for loop in (loops if r % 2 == 0 else loops[::-1]):
          sched = scheds[loop]
          if _WARMUP.value == "serve" and r == 0:
            _serve_warmup(sched, shadow_workload(wl, vocab, seed=_SEED.value + 200_000 + b),
                          b, next_id[loop], warm[loop])
            next_id[loop] += len(wl)
          sb.warm_run(sched, warm_wl, b, first_id=next_id[loop])
          next_id[loop] += len(warm_wl)
          res = sb.run_closed_loop(sched, wl, b, first_id=next_id[loop])
          next_id[loop] += len(wl)
          step_bytes = sb.decode_step_bytes(weight_bytes, kv_token, eff, wl.mean_context)
          top, share = sb.ceiling(res.tokens_per_s, step_bytes, rate, eff)
          row = dict(res.figures(), loop=loop, round=r, decode_steps=_DECODE_STEPS.value,
                     mean_context=wl.mean_context, step_bytes=step_bytes,
                     ceiling_tokens_per_s=top, ceiling_share=share, outputs=res.outputs)
          if b in device_s:
            row.update(device_step_ms=1e3 * device_s[b],
                       serving_over_device=row["step_p50_ms"] / (1e3 * device_s[b]))
          runs.setdefault((b, loop), []).append(row)
          print(f"round {r} batch {b:4d} {loop:10s}: {res.tokens_per_s:10.1f} tokens/s, step "
                f"p50 {row['step_p50_ms']:.2f} ms, {100 * share:.1f}% of the ceiling",
                flush=True)
    rows = []
    for b in batches:
      for loop in loops:
        rounds = sorted(runs[b, loop], key=lambda x: x["tokens_per_s"])
        rows.append(dict(rounds[len(rounds) // 2], rounds=len(rounds)))
    first = {b: workloads[b, 0] for b in batches}
    try:
      hf_note = _hf_compare(path, first, [x for (b, _), xs in runs.items() for x in xs
                                          if x["round"] == 0])
    except Exception as e:  # pylint: disable=broad-except  # the table still prints
      hf_note = f"transformers comparison failed: {type(e).__name__}: {e}"
  finally:
    if tmp is not None:
      shutil.rmtree(tmp, ignore_errors=True)

  agree = []
  for b in batches:
    for r in range(_REPEATS.value):
      outs = [x["outputs"] for loop in loops for x in runs[b, loop] if x["round"] == r]
      agree.append(all(o == outs[0] for o in outs))
  gbps = rate / 1e9
  print(f"\nModel: {what}, {cfg.num_layers} layers, d_model {cfg.d_model}, "
        f"{cfg.num_q_heads}/{cfg.num_kv_heads} heads x {cfg.head_dim}, vocab {cfg.vocab_size}, "
        f"{cfg.dtype}; written in {write_s:.1f} s, loaded in {load_s:.1f} s. Backend "
        f"{backend} ({jax.devices()[0].device_kind}).")
  print(f"Workload: {workloads[batches[0], 0].source}; pool {pool_config.num_blocks} blocks of "
        f"{pool_config.block_size}; max_batch {max(batches)} for every row, prefill chunk "
        f"{_PREFILL_CHUNK.value}, budget {max(_PREFILL_BUDGET.value, _PREFILL_CHUNK.value)}.")
  for loop in loops:
    w = warm[loop]
    what = (f"{w['programs']} programs" if w["mode"] == "full" else
            f"each row's workload shape served untimed ({w['requests']} requests)")
    print(f"Warm-up ({loop}): {what}, {w['compiles']} compiled, {w['cache_loads']} from the "
          f"persistent cache, {w['seconds']:.1f} s.")
  print(f"Ceiling: weights read per decode step {weight_bytes / 1e6:,.1f} MB + K/V "
        f"{kv_token} bytes per token of context, at a copy rate of {gbps:.1f} GB/s "
        f"(x + 1 over {copy_bytes >> 20} MiB, measured here)"
        + ("; on a CPU the % of the ceiling is only indicative." if not on_gpu else "."))
  print(hf_note)
  if len(loops) > 1:
    print("Loops' tokens: " + ("equal in every batch row." if all(agree) else
                               "DIFFER in some batch rows (see the record)."))
  dev_head = f" {'device':>7} {'srv/dev':>7}" if _DEVICE_STEP.value else ""
  print(f"\nServing (ms; TTFT/TPOT per request, step = one Scheduler.step; % ceil = "
        f"tokens/s over the bandwidth ceiling; compiles during the timed run)")
  print(f"{'batch':>5} {'loop':>10} {'k':>2} {'reqs':>5} {'tok/s':>10} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'step p50':>9} {'step p90':>9} "
        f"{'% ceil':>7}{dev_head} {'compiles':>8} {'= HF':>7} {'argmax':>11}")
  for r in rows:
    dev = (f" {r['device_step_ms']:7.2f} {r['serving_over_device']:6.2f}x"
           if _DEVICE_STEP.value else "")
    hf = next((x for x in runs[r["batch"], r["loop"]] if x["round"] == 0), r).get("hf")
    match = f"{hf['equal']}/{hf['compared']}" if hf else "-"
    argmax = f"{hf['tokens'] - hf['tokens_off']}/{hf['tokens']}" if hf else "-"
    print(f"{r['batch']:5d} {r['loop']:>10} {r['decode_steps']:2d} {r['requests']:5d} "
          f"{r['tokens_per_s']:10.1f} {r['ttft_p50_ms']:9.2f} {r['ttft_p99_ms']:9.2f} "
          f"{r['tpot_p50_ms']:9.2f} {r['tpot_p99_ms']:9.2f} {r['step_p50_ms']:9.2f} "
          f"{r['step_p90_ms']:9.2f} {100 * r['ceiling_share']:6.1f}%{dev} {r['compiles']:8d} "
          f"{match:>7} {argmax:>11}")
  for xs in runs.values():
    for x in xs:
      x.pop("outputs")
  rec.write({"model": dict(source=what, num_layers=cfg.num_layers, d_model=cfg.d_model,
                           num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                           head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, dtype=cfg.dtype,
                           write_s=write_s, load_s=load_s),
             "workload": workloads[batches[0], 0].source, "num_blocks": pool_config.num_blocks,
             "warmup": warm,
             "copy": dict(bytes=copy_bytes, bytes_per_s=rate), "weight_bytes": weight_bytes,
             "kv_bytes_per_token": kv_token, "loops_agree": all(agree),
             "runs": [dict(batch=b, loop=loop, rounds=xs) for (b, loop), xs in runs.items()],
             "hf_note": hf_note},
            notes=[] if on_gpu else ["CPU: the % of the bandwidth ceiling is only indicative"])


if __name__ == "__main__":
  app.run(main)

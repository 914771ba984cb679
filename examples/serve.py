"""Serve a synthetic multi-turn chat workload with the tiny model on a paged pool.

Conversations share a system prompt; each turn's prompt is the whole
conversation so far plus a new user message, so later turns hit the prefix
cache. The scheduler runs continuous batching (one forward pass per step for the
prefill chunks and decodes together, `paged_kv.scheduler.executor.ModelExecutor`)
with chunked prefill, eviction, preemption and compaction; the final report, PNG
plots and a metrics JSONL go to `--out_dir`. This is what `make demo` runs.

Telemetry as an operator sees it: every step's `StepReport` goes to the JSONL
(`metrics.jsonl`: step lines, full snapshots, and alerts as they fire, also
printed) and, with `--prometheus_port`, to a Prometheus endpoint
(`paged_kv.telemetry.export.MetricsExporter`; metrics in docs/metrics.md, a
Grafana dashboard and alert rules in deploy/). `--linger_s` keeps the endpoint
up after the run so a scraper can still read the final values.

Cold start: before serving, `Scheduler.warmup()` runs every program the serving
path can run once (compiled, or loaded from JAX's persistent compilation cache,
`--compile_cache`), and the script prints its report and the time from the start
of the script to the first token; `--nowarmup` compiles on first use instead.
The last line counts what serving cost the host in device terms
(`paged_kv.runtime.counters`): compiles after the warm-up, blocking reads, and
bookkeeping dispatches per step.

A real checkpoint: `--checkpoint DIR --prompt "..."` loads a Hugging Face
Llama-family checkpoint directory (config.json, *.safetensors; Llama, Mistral,
Qwen2; the `hf` extra) into `paged_kv.LLM` and streams the completion to stdout as
the steps produce it (`LLM.stream`), up to `--max_tokens` or an end-of-sequence
token, greedy unless `--temperature` > 0 (with `--top_p`, `--top_k`, `--seed`).
Without a tokenizer.json the prompt is comma-separated token ids. A prompt plus
`--max_tokens` beyond the checkpoint's `max_position_embeddings` is refused. User
errors (a missing directory, a bad flag value) print `error: <message>` and exit 2.
No warm-up there: one prompt compiles only the programs it runs.

Usage:
  python examples/serve.py                              # defaults, ~1-2 min on CPU
  python examples/serve.py --checkpoint=Llama-3.2-1B --prompt="The capital of France is"
  python examples/serve.py --checkpoint=Llama-3.2-1B --prompt="Once" --temperature=0.8 \
      --top_p=0.95 --seed=1 --max_tokens=64
  python examples/serve.py --num_blocks=96 --preemption=swap --prometheus_port=9400
  python examples/serve.py --prometheus_port=9400 --prometheus_addr=0.0.0.0 --linger_s=600
  python examples/serve.py --compile_cache_dir=/tmp/cc   # twice: the second run loads
"""

from __future__ import annotations

import sys
import time

# The script's start, before the heavy imports (jax, flax): "first token after" counts them.
_T0 = time.perf_counter()

from pathlib import Path  # pylint: disable=wrong-import-position

from absl import app, flags
import numpy as np
from flax import nnx

import paged_kv
from paged_kv.core import compact
from paged_kv.model import llama
from paged_kv.runtime import compile_cache, host_memory
from paged_kv.scheduler.executor import ModelExecutor
from paged_kv.scheduler.scheduler import Request, Scheduler, SchedulerConfig
from paged_kv.telemetry import plots
from paged_kv.telemetry.export import JsonlLogger, MetricsExporter, read_jsonl

_CONVERSATIONS = flags.DEFINE_integer("conversations", 16, "Concurrent chat conversations.")
_TURNS = flags.DEFINE_integer("turns", 3, "Turns per conversation.")
_SYSTEM_TOKENS = flags.DEFINE_integer("system_tokens", 48, "Shared system prompt length.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 24, "Max tokens generated per turn.")
_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 128, "Blocks in the pool.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 8, "Tokens per block.")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 8, "Sequences per step.")
_PREFILL_BUDGET = flags.DEFINE_integer("prefill_token_budget", 128, "Prompt tokens per step.")
_PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 64, "Prompt tokens per sequence per step.")
_PREEMPTION = flags.DEFINE_enum("preemption", "recompute", ["recompute", "swap"],
                                "How to preempt under pressure.")
_EVICT = flags.DEFINE_enum("evict_policy", "lru", ["lru", "cost"], "Prefix-cache eviction.")
_COMPACT_THRESHOLD = flags.DEFINE_float("compact_threshold", 0.35,
                                        "Compact when the fragmentation ratio exceeds this.")
_COMPACT_BUDGET = flags.DEFINE_integer("compact_budget", 32, "Block moves per step (0: off).")
_NO_CACHE = flags.DEFINE_bool("no_prefix_cache", False, "Disable the prefix cache.")
_BASE_POOL = flags.DEFINE_float("base_pool_fraction", 0.15,
                                "Low-address share of the pool for widely shared prefixes.")
_PROMOTE = flags.DEFINE_integer("promote_readers", 3, "Promote blocks with this many readers "
                                "into the base pool (0: off).")
_PACK = flags.DEFINE_bool("pack_tails", True, "Pack finished sequences' tails into slotted "
                          "blocks.")
_PROMETHEUS_PORT = flags.DEFINE_integer("prometheus_port", -1,
                                        "Serve /metrics on this port (0: any free port; "
                                        "-1: no exporter).")
_PROMETHEUS_ADDR = flags.DEFINE_string("prometheus_addr", "127.0.0.1",
                                       "Address the metrics endpoint binds (0.0.0.0: every "
                                       "interface).")
_LINGER = flags.DEFINE_float("linger_s", 0.0, "Keep serving /metrics this many seconds after "
                             "the run (Ctrl-C ends it early).")
_SNAPSHOT_EVERY = flags.DEFINE_integer("snapshot_every", 20, "Steps between full pool "
                                       "snapshots (internal fragmentation, both regions).")
_IMPL = flags.DEFINE_enum("impl", None, ["xla", "pallas", "mosaic"],
                          "Attention path (default: per backend, paged_kv.model.default_impl).")
_OUT_DIR = flags.DEFINE_string("out_dir", "out/serve", "Where plots and the JSONL go.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_COMPILE_CACHE = flags.DEFINE_bool("compile_cache", True, "Use JAX's persistent compilation "
                                   "cache (restarts skip XLA compiles).")
_COMPILE_CACHE_DIR = flags.DEFINE_string("compile_cache_dir", None, "The cache's directory "
                                         "(default: $PAGED_KV_COMPILE_CACHE, else "
                                         "~/.cache/paged_kv/jax).")
_RETURN_FREED = flags.DEFINE_bool("return_freed_memory", True, "Fix glibc malloc's "
                                  "thresholds so that freed large buffers go back to the OS "
                                  "(`paged_kv.runtime.host_memory`; keeps RSS flat).")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "A Hugging Face Llama/Mistral/Qwen2 "
                                  "checkpoint directory: complete --prompt with it instead of "
                                  "serving the synthetic chat workload.")
_PROMPT = flags.DEFINE_string("prompt", None, "The prompt for --checkpoint (text; comma-"
                              "separated token ids if the checkpoint has no tokenizer.json).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["bfloat16", "float16", "float32"],
                           "--checkpoint's dtype (default: its config.json's torch_dtype).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", None, "Tokens to generate for --checkpoint "
                                   "(default: --max_new_tokens).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "--checkpoint's sampling temperature "
                                  "(0: greedy).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "--checkpoint's nucleus sampling mass (1: all).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "--checkpoint's top-k sampling (0: all).")
_SAMPLE_SEED = flags.DEFINE_integer("sample_seed", None, "--checkpoint's sampling seed "
                                    "(default: --seed).")
_PRESENCE = flags.DEFINE_float("presence_penalty", 0.0, "--checkpoint's presence penalty "
                               "(vLLM's; [-2, 2], 0: off).")
_FREQUENCY = flags.DEFINE_float("frequency_penalty", 0.0, "--checkpoint's frequency penalty "
                                "(vLLM's; [-2, 2], 0: off).")
_REPETITION = flags.DEFINE_float("repetition_penalty", 1.0, "--checkpoint's repetition "
                                 "penalty (vLLM's; > 0, 1: off).")
_N = flags.DEFINE_integer("n", 1, "--checkpoint's completions of the prompt (parallel "
                         "sampling: the prompt computed once; sample i seeded seed + i); the "
                         "first streams, the others print after it.")
_WARMUP = flags.DEFINE_bool("warmup", True, "Run every program the serving path can run "
                            "before serving (Scheduler.warmup()); --nowarmup compiles each on "
                            "first use.")


class ChatWorkload:
  """Multi-turn conversations: turn t+1 is submitted when turn t finishes."""

  def __init__(self, rng: np.random.Generator, vocab: int):
    self.rng, self.vocab = rng, vocab
    self.system = rng.integers(0, vocab, _SYSTEM_TOKENS.value)
    self.history = [self.system.copy() for _ in range(_CONVERSATIONS.value)]
    self.turn = [0] * _CONVERSATIONS.value
    self.pending: dict[int, Request] = {}
    self.next_id = 0
    self.submit_time: dict[int, float] = {}

  def _submit(self, sched: Scheduler, conv: int) -> None:
    user = self.rng.integers(0, self.vocab, int(self.rng.integers(8, 40)))
    prompt = np.concatenate([self.history[conv], user])
    req = Request(self.next_id, prompt, int(self.rng.integers(4, _MAX_NEW.value + 1)),
                  arrival=time.perf_counter())
    self.next_id += 1
    self.pending[conv] = req
    sched.submit(req)

  def before_step(self, sched: Scheduler) -> None:
    for conv in range(_CONVERSATIONS.value):
      req = self.pending.get(conv)
      if req is None and self.turn[conv] == 0:
        self.turn[conv] = 1
        self._submit(sched, conv)
      elif req is not None and req.done:
        self.history[conv] = req.tokens
        del self.pending[conv]
        if self.turn[conv] < _TURNS.value:
          self.turn[conv] += 1
          self._submit(sched, conv)

  @property
  def total(self) -> int:
    return _CONVERSATIONS.value * _TURNS.value


def write_plots(out_dir: Path, jsonl: Path, maps: list, num_base_blocks: int) -> list[str]:
  """The run's timeline (from its JSONL) and block maps; [] without matplotlib."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    print("matplotlib not installed (pip install 'paged-kv[plots]'): no plots")
    return []
  steps, snaps = read_jsonl(jsonl, type="step"), read_jsonl(jsonl, type="snapshot")
  return [
      plots.timeline(steps, out_dir / "utilization.png", snapshots=snaps,
                     title=f"examples/serve.py: {_CONVERSATIONS.value} conversations x "
                           f"{_TURNS.value} turns, {_NUM_BLOCKS.value} blocks of "
                           f"{_BLOCK_SIZE.value} tokens, {_PREEMPTION.value} preemption"),
      plots.block_map(maps, out_dir / "block_map.png", num_base_blocks=num_base_blocks),
  ]


def _progress(total: int):
  try:
    from tqdm import tqdm
    return tqdm(total=total, unit="req", desc="serving", leave=False)
  except ImportError:
    return None


def _pct(values, q) -> float:
  return float(np.percentile(values, q)) if len(values) else float("nan")


class UserError(Exception):
  """A mistake in the command line: printed as `error: <message>`, exit status 2."""


def serve_checkpoint(path: Path) -> None:
  """`--checkpoint`: streams the completion of `--prompt` to stdout (`paged_kv.LLM`).

  Raises:
    UserError: no such directory, no prompt, a prompt the tokenizer or the model
      cannot take, a bad sampling value, or a prompt too long for the context.
  """
  # The hf extra, only on this path.
  # pylint: disable=import-outside-toplevel
  from paged_kv.core.errors import InvalidArgument
  from paged_kv.model import hf_checkpoint
  from paged_kv.model.tokenizer import Tokenizer
  from paged_kv.scheduler.sampling_params import SamplingParams
  if not path.is_dir():
    raise UserError(f"checkpoint directory {str(path)!r} does not exist" if not path.exists()
                    else f"--checkpoint {str(path)!r} is not a directory")
  if _PROMPT.value is None:
    raise UserError("--checkpoint needs --prompt")
  max_tokens = _MAX_TOKENS.value if _MAX_TOKENS.value is not None else _MAX_NEW.value
  try:
    tok = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    if tok is not None:
      prompt: str | list[int] = _PROMPT.value
      num_prompt = len(tok.encode(_PROMPT.value))
    else:
      try:
        prompt = [int(t) for t in _PROMPT.value.split(",")]
      except ValueError:
        raise UserError(f"{path} has no tokenizer.json: --prompt must be comma-separated "
                        f"token ids") from None
      num_prompt = len(prompt)
    sampling = SamplingParams(temperature=_TEMPERATURE.value, top_p=_TOP_P.value,
                              top_k=_TOP_K.value, seed=_SAMPLE_SEED.value
                              if _SAMPLE_SEED.value is not None else _SEED.value,
                              presence_penalty=_PRESENCE.value,
                              frequency_penalty=_FREQUENCY.value,
                              repetition_penalty=_REPETITION.value, n=_N.value)
    # Serve this prompt's length, within the checkpoint's context: a longer request is
    # refused by the facade (ContextLengthExceeded), never generated past it.
    context = hf_checkpoint.read_hf_config(path).get("max_position_embeddings")
    need = num_prompt + max(max_tokens, 1)
    max_seq_len = min(need, context) if isinstance(context, int) else need
    per_seq = -(-max_seq_len // _BLOCK_SIZE.value)
    n = sampling.n
    llm = paged_kv.LLM(path, tokenizer=tok, dtype=_DTYPE.value, max_seq_len=max_seq_len,
                       max_batch=n, block_size=_BLOCK_SIZE.value,
                       num_blocks=max(_NUM_BLOCKS.value, n * (per_seq + 1)), impl=_IMPL.value)
    stream = llm.stream(prompt, sampling, max_tokens=max_tokens)
    print(_PROMPT.value, end="", flush=True)
    t0, generated, reason = time.perf_counter(), 0, ""
    others: list[list[str]] = [[] for _ in range(n)]  # samples 1.. print after the first
    for chunk in stream:
      generated += len(chunk.token_ids)
      piece = chunk.text if chunk.text is not None else "".join(
          f",{t}" for t in chunk.token_ids)
      if chunk.sample:
        others[chunk.sample].append(piece)
        continue
      print(piece, end="", flush=True)
      reason = chunk.finish_reason or reason
    for i in range(1, n):
      print(f"\n[sample {i}] {_PROMPT.value}{''.join(others[i])}", end="", flush=True)
  except InvalidArgument as err:
    raise UserError(str(err)) from None
  wall = time.perf_counter() - t0
  config = llm.model_config
  print(f"\n[{llm.model_type} {config.num_layers} layers {config.dtype}: {num_prompt} prompt "
        f"tokens, {generated} generated in {wall:.1f} s (compiles included), stop: {reason}"
        f"{f' (sample 0), {n} samples' if n > 1 else ''}]")


def main(argv):
  del argv
  if _RETURN_FREED.value:
    host_memory.return_freed_memory()
  if _COMPILE_CACHE.value:
    compile_cache.enable_compilation_cache(_COMPILE_CACHE_DIR.value)
  if _CHECKPOINT.value is not None:
    try:
      serve_checkpoint(Path(_CHECKPOINT.value))
    except UserError as err:
      print(f"error: {err}", file=sys.stderr)
      sys.exit(2)
    return
  out_dir = Path(_OUT_DIR.value)
  out_dir.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(_SEED.value)
  model_config = llama.LlamaConfig(num_layers=2)
  model = llama.TinyLlama(model_config, rngs=nnx.Rngs(_SEED.value))
  pool_config = llama.pool_config_for(model_config, num_blocks=_NUM_BLOCKS.value,
                                   block_size=_BLOCK_SIZE.value, max_seqs=_MAX_BATCH.value,
                                   max_segments=64, base_pool_fraction=_BASE_POOL.value)
  pool = paged_kv.BlockPool(pool_config)
  policy = (compact.CompactionPolicy(threshold=_COMPACT_THRESHOLD.value,
                                     budget=_COMPACT_BUDGET.value)
            if _COMPACT_BUDGET.value > 0 else None)
  config = SchedulerConfig(max_batch=_MAX_BATCH.value,
                           prefill_token_budget=_PREFILL_BUDGET.value,
                           prefill_chunk=_PREFILL_CHUNK.value, preemption=_PREEMPTION.value,
                           enable_prefix_cache=not _NO_CACHE.value,
                           evict_policy=_EVICT.value, compaction=policy,
                           pack_tails=_PACK.value, promote_readers=_PROMOTE.value,
                           snapshot_every=_SNAPSHOT_EVERY.value)
  jsonl = out_dir / "metrics.jsonl"
  logger = JsonlLogger(jsonl, mode="w")  # this run only; alerts are written as they fire
  exporter = None
  if _PROMETHEUS_PORT.value >= 0:
    exporter = MetricsExporter(port=_PROMETHEUS_PORT.value, addr=_PROMETHEUS_ADDR.value,
                               model="tiny-llama", replica="0").start()
    print(f"Prometheus metrics at {exporter.url}")
  workload = ChatWorkload(rng, model_config.vocab_size)
  maps: dict[str, tuple[int, np.ndarray]] = {}
  peak = {"usage": -1.0, "frag": -1.0}
  first_token_s: list[float] = []  # seconds from the script's start to the first token
  host_seconds: list[float] = []

  def on_step(report) -> None:
    logger.log_report(report)  # step line, snapshot line, alert lines (flushed)
    host_seconds.append(report.host_seconds)
    if report.first_token_latencies and not first_token_s:
      first_token_s.append(time.perf_counter() - _T0)
      say(f"first token after {first_token_s[0]:.1f} s"
          f"{' (warm-up included)' if _WARMUP.value else ''}")
    for alert in report.alerts:
      say(f"ALERT step {report.step} [{alert.severity}] {alert.metric} = {alert.value:.3g} "
          f"> {alert.threshold:.3g}: {alert.likely_cause}; {alert.suggested_action}")
    st = report.pool
    if st is not None:
      if st.kv_usage_ratio > peak["usage"]:
        peak["usage"] = st.kv_usage_ratio
        maps["busiest step"] = (report.step, plots.block_states(pool.state))
      if st.fragmentation_ratio > peak["frag"]:
        peak["frag"] = st.fragmentation_ratio
        maps["most fragmented step"] = (report.step, plots.block_states(pool.state))
    if bar is not None:
      bar.n = report.stats.finished
      if st is not None:
        bar.set_postfix(kv=f"{st.kv_usage_ratio:.0%}", cached=f"{st.cached_blocks}",
                        frag=f"{st.fragmentation_ratio:.2f}", refresh=False)
      bar.refresh()

  sched = Scheduler(pool, ModelExecutor(model, pool_config, impl=_IMPL.value), config,
                    on_step=on_step, clock=time.perf_counter)
  if exporter is not None:
    exporter.attach(sched)  # chained after on_step
  if _WARMUP.value:
    print(sched.warmup(), flush=True)
  at_serve = sched.runtime  # device traffic before serving (the warm-up's)
  bar = _progress(workload.total)  # (on_step reads `bar` and `say`)
  say = bar.write if bar is not None else print
  t0 = time.perf_counter()
  sched.run(before_step=workload.before_step)
  wall = time.perf_counter() - t0
  serving = sched.runtime.since(at_serve)  # the serving loop's device traffic only
  if bar is not None:
    bar.close()
  last = sched.take_snapshot()
  logger.log_snapshot(last, step=sched.stats.steps - 1)
  if exporter is not None:
    exporter.observe_snapshot(last, step=sched.stats.steps - 1)
  logger.close()
  maps["end"] = (sched.stats.steps - 1, plots.block_states(pool.state))
  sched.check_invariants()

  reqs = sorted(sched.finished, key=lambda r: r.request_id)
  ttft = np.array([r.first_token_time - r.submit_time for r in reqs])
  first_turn = np.array([r.request_id < _CONVERSATIONS.value for r in reqs])
  steps = read_jsonl(jsonl, type="step")
  snaps = read_jsonl(jsonl, type="snapshot")
  kv = [r["pool"]["kv_usage_ratio"] for r in steps if r["pool"]]
  cached = [r["pool"]["cached_blocks"] / r["pool"]["num_blocks"] for r in steps if r["pool"]]
  frag = [r["pool"]["fragmentation_ratio"] for r in steps if r["pool"]]
  generated = sum(len(r.output) for r in reqs)
  st = sched.stats
  order = ["busiest step", "most fragmented step", "end"]
  plot_paths = write_plots(out_dir, jsonl, [(k, *maps[k]) for k in order if k in maps],
                           pool_config.num_base_blocks)
  late = serving.backend_compiles > 0  # programs compiled while serving
  loop = (("warm-up excluded, " if _WARMUP.value else "")
          + f"{serving.backend_compiles} XLA compiles in it")
  rows = [
      ("requests finished", f"{st.finished} / {workload.total}", "requests done / submitted"),
      ("steps", st.steps, "scheduler steps: one mixed prefill + decode forward pass each"),
      ("generated tokens", generated, "output tokens of all requests"),
      ("tokens/s (generated, wall)", f"{generated / wall:.0f}",
       f"generated tokens / wall time of the serving loop ({loop})"),
      ("TTFT p50 / p99, all (s)", f"{_pct(ttft, 50):.3f} / {_pct(ttft, 99):.3f}",
       "submit to first token, queue included"
       + ("; the first requests include XLA compilation" if late else "")),
      ("TTFT p50 / p99, turns 2+ (s)",
       f"{_pct(ttft[~first_turn], 50):.3f} / {_pct(ttft[~first_turn], 99):.3f}",
       "turns 2 and later" + (" (turn 1 waits for the first compiles; a step shape first "
                              "seen later still compiles)" if late else "")),
      ("host time per step p50 / max (s)",
       f"{_pct(host_seconds, 50):.4f} / {max(host_seconds, default=0):.3f}",
       "wall time of one scheduler step" + (" (the max is a compile)" if late else "")),
      ("prefix cache hit rate (prompt tokens)", f"{st.prefix_cache_hit_rate:.1%}",
       "prompt tokens found in the cache / prompt tokens looked up"),
      ("evicted tokens", st.evicted_tokens, "tokens dropped from the prefix cache for room"),
      ("KV usage mean / max", f"{np.mean(kv):.1%} / {max(kv):.1%}",
       "blocks used by live sequences / all (cached-only blocks count as free, as vLLM)"),
      ("cached-only blocks mean / max", f"{np.mean(cached):.1%} / {max(cached):.1%}",
       "blocks held only by the prefix cache (evictable) / all"),
      ("fragmentation ratio mean / p99", f"{np.mean(frag):.3f} / {_pct(frag, 99):.3f}",
       "1 - largest free run / free blocks, dynamic region, every step"),
      ("internal fragmentation mean",
       f"{np.mean([s['internal_fragmentation'] for s in snaps]):.1%}",
       f"dead slots in used blocks / their slots, full snapshots (every "
       f"{_SNAPSHOT_EVERY.value} steps)"),
      ("compactions / block moves", f"{st.compactions} / {st.compaction_moves}",
       "compaction passes and the blocks they moved"),
      ("packed tails / base-pool promotions", f"{st.pack_moves} / {st.promotions}",
       "tails moved into shared slotted blocks / blocks pinned into the base region"),
      ("preemptions (recompute / swap)", f"{st.preemptions} ({st.preemptions_recompute} / "
                                         f"{st.preemptions_swap})",
       "sequences pushed out for room: recomputed later, or K/V copied to host"),
      ("swap to host bytes", st.swap_to_host_bytes, "K/V bytes copied out by swap preemption"),
      ("OOMs by reason", dict(st.oom_by_reason) or "none",
       "failed block allocations (the scheduler then evicts or preempts)"),
      ("max concurrent sequences", st.max_running, "most sequences in one step's batch"),
      ("alerts", len(sched.alerts), f"threshold alerts fired (lines of type alert in "
                                     f"{jsonl.name})"),
      ("wall time (s)", f"{wall:.1f}", f"the serving loop ({loop})"),
  ]
  print("\n| metric | value | meaning |\n|---|---|---|")
  for name, value, meaning in rows:
    print(f"| {name} | {value} | {meaning} |")
  print(f"\nmetrics JSONL: {jsonl}")
  for p in plot_paths:
    print(f"plot: {p}")
  steps_run = max(st.steps, 1)
  compiled = (f"{st.compiles_after_warmup} compiles after the warm-up" if _WARMUP.value
              else f"{serving.backend_compiles} compiles (no warm-up)")
  print(f"runtime while serving: {compiled}, {serving.blocking_reads} blocking reads, "
        f"{serving.bookkeeping_dispatches / steps_run:.2f} bookkeeping dispatches per step"
        + (f" (warm-up included: {st.blocking_reads} blocking reads, "
           f"{st.bookkeeping_dispatches / steps_run:.2f} per step)" if _WARMUP.value else ""))
  if exporter is not None:
    if _LINGER.value > 0:
      print(f"serving {exporter.url} for {_LINGER.value:g} s more (Ctrl-C to stop)", flush=True)
      try:
        time.sleep(_LINGER.value)
      except KeyboardInterrupt:
        pass
    exporter.stop()


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, a bad flag answered `error: <message>` and exit status 2."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)

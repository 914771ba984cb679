"""Decode throughput of the tiny Llama on a paged pool: k decode steps per jit call.

k = 1 is one `decode_step` per token (a host round trip per token); k > 1 is
`decode_multi`, a `lax.scan` of k steps (reserve, write, attend, sample on device)
with the host only between chunks. Each repeat starts from a fresh pool, prefills
the prompts (not timed), then times the decode of `--num_tokens` tokens per
sequence through `PagedRunner.decode` (which reads the tokens back after every
call, as a serving loop must). Before printing, the outputs of every k are checked
equal to each other and to the dense reference.

Every k is compiled and warmed first; then each repeat times every k once, in turn,
so the speedup over the first k is paired within a repeat and reported as the median
with [min-max] over the repeats (tokens/s: medians).

Usage:
  PYTHONPATH=. python benchmarks/bench_decode.py [--batch=8 --num_tokens=64 --steps=1,8,32 --repeats=5]
"""

from __future__ import annotations

import math
import statistics
import time

from absl import app, flags
import numpy as np
from flax import nnx

from benchmarks import records, shared_flags
from paged_kv.model import llama, resolve_impl
from paged_kv.model.reference import dense_mismatches
from paged_kv.model.runner import PagedRunner, SequenceRecord

_BATCH = flags.DEFINE_integer("batch", 8, "Sequences decoded together.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per sequence.")
_NUM_TOKENS = flags.DEFINE_integer("num_tokens", 64, "Decoded (timed) tokens per sequence.")
_STEPS = flags.DEFINE_list("steps", ["1", "8", "32"], "Decode steps per jit call (k).")
_REPEATS = shared_flags.define_repeats(5, "Timed repeats per k (median reported).")
_BLOCK_SIZE = shared_flags.define_block_size("Tokens per pool block.")
_NUM_LAYERS = flags.DEFINE_integer("num_layers", 2, "Decoder layers of the tiny model.")
_IMPL = flags.DEFINE_enum("impl", None, ["xla", "pallas", "mosaic"],
                          "Attention path (default: per backend, paged_kv.model.default_impl).")
_INTERPRET = flags.DEFINE_bool("interpret", None, "Pallas interpret mode (default: on CPU).")
_SEED = shared_flags.define_seed("Weights and prompts seed.")
_RECORD = shared_flags.define_record()


def _run_once(model, pool_config, prompts, steps_per_call: int) -> tuple[float, list[list[int]]]:
  """Prefills, then times the decode; returns (seconds, token lists)."""
  runner = PagedRunner(model, pool_config, prefill_chunk=_PROMPT_LEN.value,
                          impl=_IMPL.value, interpret=_INTERPRET.value)
  seqs = [runner.open(p, max_new_tokens=_NUM_TOKENS.value + 1) for p in prompts]
  runner.prefill(seqs)
  runner.state.pages.k.block_until_ready()
  start = time.perf_counter()
  runner.decode(seqs, num_tokens=_NUM_TOKENS.value, steps_per_call=steps_per_call)
  runner.state.pages.k.block_until_ready()
  elapsed = time.perf_counter() - start
  return elapsed, [runner.records[s].tokens for s in seqs]


def main(argv):
  del argv
  config = llama.LlamaConfig(num_layers=_NUM_LAYERS.value)
  model = llama.TinyLlama(config, rngs=nnx.Rngs(_SEED.value))
  bs = _BLOCK_SIZE.value
  per_seq = math.ceil((_PROMPT_LEN.value + _NUM_TOKENS.value + 1) / bs) + 1
  pool_config = llama.pool_config_for(config, num_blocks=_BATCH.value * per_seq + 1, block_size=bs,
                                   max_seqs=_BATCH.value, max_segments=per_seq + 1)
  rng = np.random.default_rng(_SEED.value)
  prompts = rng.integers(0, config.vocab_size, (_BATCH.value, _PROMPT_LEN.value)).tolist()
  steps = [int(s) for s in _STEPS.value]
  bad = [k for k in steps if k < 1 or _NUM_TOKENS.value % k]
  if bad:
    raise app.UsageError(f"--steps {bad}: each k must be >= 1 and divide --num_tokens")

  rec = records.Recorder(_RECORD.value, "bench_decode", flag_values=records.script_flags(),
                         seeds=[_SEED.value])
  times = {k: [] for k in steps}
  reference = None
  for k in steps:
    _run_once(model, pool_config, prompts, k)  # compile and warm up
  for _ in range(_REPEATS.value):
    for k in steps:
      seconds, tokens = _run_once(model, pool_config, prompts, k)
      times[k].append(seconds)
      if reference is None:
        reference = tokens
        seq_records = [SequenceRecord(tokens=t, sampled=[False] * _PROMPT_LEN.value
                                      + [True] * (len(t) - _PROMPT_LEN.value), remaining=0)
                       for t in tokens]
        mismatches = dense_mismatches(model, seq_records)
        if mismatches:
          raise AssertionError(f"paged decode differs from the dense reference: {mismatches[:5]}")
      elif tokens != reference:
        raise AssertionError(f"k={k} produced different tokens than k={steps[0]}")

  generated = _BATCH.value * _NUM_TOKENS.value
  print(f"batch={_BATCH.value} prompt={_PROMPT_LEN.value} decoded={_NUM_TOKENS.value}/seq "
        f"block_size={bs} layers={_NUM_LAYERS.value} impl={resolve_impl(_IMPL.value)[0]} "
        f"repeats={_REPEATS.value} (median); outputs equal across k and to the dense reference")
  print(f"{'k':>4} {'median s':>10} {'tokens/s':>10}  vs k={steps[0]}, paired per repeat: "
        "median [min-max]")
  base = times[steps[0]]
  for k in steps:
    med = statistics.median(times[k])
    speedup = records.format_median_range([b / t for b, t in zip(base, times[k])], suffix="x")
    print(f"{k:>4} {med:>10.4f} {generated / med:>10.0f}  {speedup}")
  rec.write({"batch": _BATCH.value, "prompt_len": _PROMPT_LEN.value,
             "num_tokens": _NUM_TOKENS.value, "generated": generated,
             "impl": resolve_impl(_IMPL.value)[0], "steps": steps,
             "seconds": {str(k): v for k, v in times.items()}})


if __name__ == "__main__":
  app.run(main)

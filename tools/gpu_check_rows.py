"""The rows of `tools/gpu_check.py`: the plan (plain data) and what runs one row.

The plan (`plan(dry)`, `shapes(dry)`) imports nothing heavy, so the driver can
budget, order and report rows without importing JAX. `run_row(row_id, ...)`
runs in the driver's worker process (JAX imported there): it builds the row's
inputs, calls the public API once, checks the numbers against an independent
reference (wrong numbers are never timed), then times chained calls.

Public APIs used (keyword arguments that exist in the 0.2 release and in the
issue-22 rework both): `paged_kv.model.attention.paged_attention(q, k, v, pages,
layer, meta, impl=...)`, `paged_kv.model.attention.default_impl`,
`pallas_kernels.permute_blocks.permute_blocks(pages, src, dst, impl=...,
interpret=...)`, and JAX's `jax.experimental.pallas.ops.gpu.paged_attention`.
The serving rows use `paged_kv.model.random_checkpoint`, `hf_checkpoint`,
`paged_kv.sim.serving_bench` (Scheduler + ModelExecutor, `PagedRunner`) and
`paged_kv.model.hf_reference` (transformers).

Byte counts: attention rows count whole blocks touched (K and V, every block a
row's segments name, read once); a permutation moves `moves x layers x heads`
chunks, read and written; a copy reads and writes its buffer. `% copy` compares
the row with a plain device copy (`x + 1` on bf16) moving the same number of
bytes (`copy/<key>` rows). A serving row's bytes are those one decode step reads
(weights + the batch's K/V at its mean context); its `us/call` is the wall time per
`batch` output tokens, so `% copy` is the share of the bandwidth ceiling.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import statistics
import time
import warnings

# Shapes -------------------------------------------------------------------------

BF16, FP8 = "bfloat16", "float8_e4m3fn"
TOL = 2e-2  # max per-token relative L2 error (bf16 outputs, f32 accumulation)


@dataclasses.dataclass(frozen=True)
class AttnShape:
  """One Llama-style attention layer's step: `decode_rows` rows of one new token
  at `decode_ctx` tokens of context (the new one included), then `prefill_rows`
  rows of `prefill_chunk` new tokens on `prefill_prefix` cached ones. The pool
  has `num_layers` layers (the row attends at `layer`) and `slack` more blocks
  than the tables use (unused, NaN: a stray read poisons the output)."""
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  block_size: int
  dtype: str
  decode_rows: int = 0
  decode_ctx: int = 0
  prefill_rows: int = 0
  prefill_prefix: int = 0
  prefill_chunk: int = 0
  num_layers: int = 2
  layer: int = 1
  slack: float = 0.125
  check_table: bool = False  # the hand-built correctness table (`_check_table`)

  @property
  def blocks_used(self) -> int:
    bs = self.block_size
    return (self.decode_rows * -(-self.decode_ctx // bs)
            + self.prefill_rows * -(-(self.prefill_prefix + self.prefill_chunk) // bs))

  @property
  def nbytes(self) -> int:
    """Bytes of K and V in the blocks the tables touch."""
    itemsize = 1 if self.dtype == FP8 else 2
    return (2 * self.blocks_used * self.num_kv_heads * self.block_size * self.head_dim
            * itemsize)

  def describe(self) -> str:
    parts = []
    if self.check_table:
      parts.append("mixed check table (shared prefix cut in a block, slotted block, "
                   "padding row and tokens, garbage table entries, NaN pages)")
    if self.decode_rows:
      parts.append(f"{self.decode_rows} decode x {self.decode_ctx}")
    if self.prefill_rows:
      parts.append(f"{self.prefill_rows} prefill x ({self.prefill_prefix} cached + "
                   f"{self.prefill_chunk} new)")
    return (", ".join(parts) + f"; {self.num_q_heads}/{self.num_kv_heads} heads, "
            f"D{self.head_dim}, {self.dtype}, block {self.block_size}, pool "
            f"{self.num_layers} layers (layer {self.layer})")


@dataclasses.dataclass(frozen=True)
class PermShape:
  """`num_moves` block moves (+ `num_padding` padding moves) in a pool
  `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]` (one of K/V)."""
  num_moves: int
  num_layers: int
  num_kv_heads: int
  num_blocks: int
  block_size: int
  head_dim: int
  dtype: str = BF16
  num_padding: int = 0

  @property
  def nbytes(self) -> int:
    """Bytes read plus written."""
    return (2 * self.num_moves * self.num_layers * self.num_kv_heads * self.block_size
            * self.head_dim * 2)

  def describe(self) -> str:
    pad = f" + {self.num_padding} padding" if self.num_padding else ""
    return (f"{self.num_moves} moves{pad}, pool {self.num_layers}x{self.num_kv_heads}"
            f"x{self.num_blocks}x{self.block_size}x{self.head_dim} {self.dtype}")


def _random_checkpoint():
  """`paged_kv/model/random_checkpoint.py` loaded by its path (numpy only): the driver
  sizes the serving rows without importing JAX."""
  import importlib.util
  import pathlib
  import sys
  name = "_gpu_check_random_checkpoint"
  if name not in sys.modules:
    path = pathlib.Path(__file__).resolve().parents[1] / "paged_kv/model/random_checkpoint.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
  return sys.modules[name]


@dataclasses.dataclass(frozen=True)
class ServingShape:
  """A serving run: a random Hugging Face checkpoint of shape `model`
  (`paged_kv.model.random_checkpoint`) in `dtype`, served by `Scheduler` +
  `ModelExecutor` at `max_batch` (one program set for every batch), `batch`
  requests in flight (0: the rows shared by every batch), `num_requests` random
  prompts of `prompt_len` tokens generating `output_len` each."""
  model: str
  dtype: str
  batch: int
  max_batch: int
  prompt_len: int
  output_len: int
  num_requests: int
  prefill_chunk: int
  prefill_budget: int
  block_size: int = 16

  @property
  def hf_config(self) -> dict:
    return _random_checkpoint().hf_config(self.model, dtype=self.dtype)

  @property
  def weight_bytes(self) -> int:
    """Parameters a decode step reads: all but an untied input embedding."""
    hf = self.hf_config
    n = _random_checkpoint().num_parameters(hf)
    if not hf["tie_word_embeddings"]:
      n -= hf["vocab_size"] * hf["hidden_size"]
    return n * (4 if self.dtype == "float32" else 2)

  @property
  def nbytes(self) -> int:
    """Weights + the K/V of `max(batch, 1)` rows at the mean context (prompt + half
    the output): what one decode step reads."""
    hf = self.hf_config
    d = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    kv = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * d * (
        4 if self.dtype == "float32" else 2)
    return int(self.weight_bytes
               + max(self.batch, 1) * (self.prompt_len + self.output_len / 2) * kv)

  def describe(self) -> str:
    rows = (f"batch {self.batch}: {self.num_requests} requests of " if self.batch
            else "requests of ")
    return (f"random {self.model} checkpoint ({self.dtype}), max_batch {self.max_batch}, "
            f"{rows}{self.prompt_len} prompt + {self.output_len} output tokens, prefill "
            f"chunk {self.prefill_chunk} budget {self.prefill_budget}, block {self.block_size}")


def _serving_shapes(dry: bool) -> dict:
  if dry:
    base = dict(model="tiny", dtype="float32", max_batch=2, prompt_len=16, output_len=8,
                prefill_chunk=16, prefill_budget=16)
    batches = {"b1": 1, "b64": 2}
  else:
    base = dict(model="llama-3.2-1b", dtype="bfloat16", max_batch=64, prompt_len=512,
                output_len=128, prefill_chunk=512, prefill_budget=512)
    batches = {"b1": 1, "b64": 64}
  out = {"serving-1b": ServingShape(batch=0, num_requests=0, **base)}
  for name, b in batches.items():
    out[f"serving-1b-{name}"] = ServingShape(batch=b, num_requests=max(2 * b, 4), **base)
  return out


def _prefill_shape(dry: bool) -> dict:
  """The model prefill row's shape (not served by the loops: their warm-up serves the
  `_serving_shapes` batches only)."""
  base = _serving_shapes(dry)["serving-1b"]
  chunk = 32 if dry else PREFILL_CHUNK_ROW
  return {"serving-1b-prefill": dataclasses.replace(
      base, batch=1, num_requests=1, prompt_len=chunk, prefill_chunk=chunk,
      prefill_budget=chunk)}


PREFILL_CHUNK_ROW = 2048
"""New tokens of the model prefill row (`serving/prefill2k/1b`), one chunk on an empty row."""


def shapes(dry: bool) -> dict:
  """Shape key -> AttnShape | PermShape | ServingShape. Keys are the same in both
  modes; the dry mode's shapes are tiny (CPU, interpret mode), same structure."""
  if dry:
    llama = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=BF16)
    b1 = dict(decode_rows=1, decode_ctx=256)
    b64 = dict(decode_rows=3, decode_ctx=64)
    mixed = dict(decode_rows=2, decode_ctx=64, prefill_rows=1, prefill_prefix=32,
                 prefill_chunk=16)
    prefill = dict(prefill_rows=1, prefill_prefix=16, prefill_chunk=32)
    dims = {"d64": 32, "d256": 128}
    perm = dict(num_layers=2, num_kv_heads=2, block_size=16, head_dim=64)
    moves = {"perm32": (4, 64), "perm256": (8, 64), "perm1024": (16, 64)}
    check_perm = PermShape(num_moves=13, num_padding=2, num_blocks=48, **perm)
  else:
    llama = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=BF16)
    b1 = dict(decode_rows=1, decode_ctx=131072)
    b64 = dict(decode_rows=64, decode_ctx=8192)
    mixed = dict(decode_rows=56, decode_ctx=8192, prefill_rows=8, prefill_prefix=4096,
                 prefill_chunk=256)
    prefill = dict(prefill_rows=8, prefill_prefix=4096, prefill_chunk=2048)
    dims = {"d64": 64, "d256": 256}
    perm = dict(num_layers=32, num_kv_heads=8, block_size=16, head_dim=128)
    moves = {"perm32": (32, 512), "perm256": (256, 1024), "perm1024": (1024, 4096)}
    check_perm = PermShape(num_moves=37, num_padding=3, num_blocks=128,
                           **dict(perm, num_layers=4))
  fp8 = dict(llama, dtype=FP8)
  out = {
      "check": AttnShape(**llama, check_table=True),
      "check-fp8": AttnShape(**fp8, check_table=True),
      "check-perm": check_perm,
      "b1x128k": AttnShape(**llama, **b1),
      "b1x128k-fp8": AttnShape(**fp8, **b1),
      "b64x8k": AttnShape(**llama, **b64),
      "b64x8k-fp8": AttnShape(**fp8, **b64),
      "b64x8k-d64": AttnShape(**dict(llama, head_dim=dims["d64"]), **b64),
      "b64x8k-d256": AttnShape(**dict(llama, head_dim=dims["d256"]), **b64),
      "mixed": AttnShape(**llama, **mixed),
      "prefill8x2k": AttnShape(**llama, **prefill),
  }
  for key, (m, nb) in moves.items():
    out[key] = PermShape(num_moves=m, num_blocks=nb, **perm)
  out.update(_serving_shapes(dry))
  out.update(_prefill_shape(dry))
  out.update(block_size_shapes(out))
  return out


# Plan ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RowSpec:
  """One row of the table.

  id: `group/key[/impl]`, the same in dry and full mode.
  kind: what `run_row` does (check_attn, check_perm, copy, builtin, dense, layer, perm).
  impl: the impl asked for; None = the library default (`impl=None`).
  key: the shape key (`shapes()`).
  limit_s / dry_limit_s: wall limit of the row (worker kill past it).
  est_s: expected wall seconds on an H200 (compile + check + timing).
  copy_ref / builtin_ref: rows this one's `% copy` and `x builtin` divide by.
  device_ref: the device-step row a serving row's step is compared with.
  needs: rows that, if they hung or crashed, make this one skip (same kernel).
  goals: {"copy_pct": min %, "x_builtin": min ratio} from issue 22;
    {"serving_over_device": max ratio} (serving step p50 / device step).
  pages_per_step: a "decode_kernel" row's `pages_per_step` (see
    `decode_variant_rows`).
  step_kw: keyword arguments the layer and check rows pass to `paged_attention`
    besides `impl` (e.g. `mixed_launches`).
  """
  id: str
  kind: str
  key: str
  impl: str | None = None
  limit_s: float = 60
  dry_limit_s: float = 90  # interpret mode on a CPU that may be shared (dry budget: 300 s)
  est_s: float = 10
  copy_ref: str | None = None
  builtin_ref: str | None = None
  device_ref: str | None = None
  needs: tuple[str, ...] = ()
  goals: dict | None = None
  pages_per_step: int | None = None  # "decode_kernel" rows: the variant's stage
  step_kw: tuple = ()  # (name, value) pairs: more `paged_attention` keyword arguments


def _layer_rows(key, impls, *, copy_ref, builtin_ref=None, limit=60, est=10,
                goals=None, check="check/attn"):
  """Model-layer rows of shape `key`, one per impl (None: the default path, the
  one the goals judge); each needs `<check>/<impl>` not to have hung."""
  return [RowSpec(f"layer/{key}/{impl or 'default'}", "layer", key, impl, limit_s=limit,
                  est_s=est, copy_ref=copy_ref, builtin_ref=builtin_ref,
                  needs=(f"{check}/{impl or 'default'}",),
                  goals=goals if impl is None else None)
          for impl in impls]


def _perm_rows(key, copy_ref):
  return [RowSpec(f"perm/{key}/{impl}", "perm", key, impl, limit_s=45, est_s=5,
                  copy_ref=copy_ref, needs=(f"check/perm/{impl}",),
                  goals={"copy_pct": 80})
          for impl in ("xla", "pallas", "mosaic")]


SERVING_LOOPS = (("overlapped", True), ("sync", False))
"""The loops the serving rows measure, in order (`SchedulerConfig.overlap`)."""


def serving_rows() -> list[RowSpec]:
  """The serving rows (ids start with `serving/`, so `--skip=serving/` leaves them
  out): the 1B shape at batch 64 and 1 through the overlapped and the synchronous
  loop, after the checkpoint (written and loaded once per worker) and the device's own
  decode step per batch; each loop's scheduler (max_batch 64 for both batches) is
  warmed by a row of its own that serves both batches' workload shapes untimed, so it
  compiles only the model programs they run (the two loops share them: the second
  loop's warm-up compiles nothing); then transformers on the same checkpoint; last,
  the cold start (`Scheduler.warmup()` in fresh processes, cold and from the
  persistent cache; issue V). Estimates are for an H200 (~9 s per 1B model program
  before the layers were scanned)."""
  rows = [
      RowSpec("serving/copy/1b", "copy", "serving-1b-b64", limit_s=30, est_s=3),
      RowSpec("serving/checkpoint/1b", "serving_checkpoint", "serving-1b", limit_s=150,
              est_s=40),
  ]
  for b in ("b64", "b1"):
    rows.append(RowSpec(f"serving/device/1b-{b}", "serving_device", f"serving-1b-{b}",
                        limit_s=90, est_s=25, copy_ref="serving/copy/1b",
                        needs=("serving/checkpoint/1b",)))
  for i, (loop, _) in enumerate(SERVING_LOOPS):
    rows.append(RowSpec(f"serving/warmup/1b-{loop}", "serving_warmup", "serving-1b", loop,
                        limit_s=180, dry_limit_s=150, est_s=95 if i == 0 else 20,
                        needs=("serving/checkpoint/1b",)))
    for b in ("b64", "b1"):
      rows.append(RowSpec(f"serving/1b-{b}/{loop}", "serving", f"serving-1b-{b}", loop,
                          limit_s=60, est_s=8, copy_ref="serving/copy/1b",
                          device_ref=f"serving/device/1b-{b}",
                          needs=(f"serving/warmup/1b-{loop}",),
                          goals={"serving_over_device": 1.1}))
  rows.append(RowSpec("serving/prefill2k/1b", "serving_prefill", "serving-1b-prefill",
                      limit_s=90, est_s=20, needs=("serving/checkpoint/1b",)))
  rows.append(RowSpec("serving/transformers/1b", "serving_hf", "serving-1b", limit_s=90,
                      est_s=25, needs=("serving/checkpoint/1b",)))
  rows.append(RowSpec("serving/coldstart/1b-b64", "serving_cold_start", "serving-1b-b64",
                      limit_s=150, dry_limit_s=240, est_s=50,
                      needs=("serving/checkpoint/1b",)))
  return rows


def plan(dry: bool = False) -> list[RowSpec]:
  """Every row, cheapest first: correctness at small shapes (each impl), then
  timings in order of bytes moved, each shape's same-bytes copy first; then the
  serving rows (`serving_rows`)."""
  del dry  # same rows in both modes (tiny shapes in dry mode)
  decode_impls = ("pallas", "mosaic", "xla")
  rows = [
      RowSpec("check/perm/xla", "check_perm", "check-perm", "xla", 45, est_s=3),
      RowSpec("check/perm/pallas", "check_perm", "check-perm", "pallas", 45, est_s=4),
      RowSpec("check/perm/mosaic", "check_perm", "check-perm", "mosaic", 45, est_s=5),
      RowSpec("check/attn/xla", "check_attn", "check", "xla", 60, est_s=5),
      RowSpec("check/attn/default", "check_attn", "check", None, 60, est_s=8),
      RowSpec("check/attn/pallas", "check_attn", "check", "pallas", 60, est_s=8),
      RowSpec("check/attn/mosaic", "check_attn", "check", "mosaic", 60, est_s=10,
              step_kw=(("prefill_impl", "pallas"),)),  # decode: the Mosaic rows' check
      *prefill_check_rows(),
      RowSpec("check/attn-fp8/default", "check_attn", "check-fp8", None, 60, est_s=8),
      # 64 MiB moved.
      RowSpec("copy/perm32", "copy", "perm32", limit_s=30, est_s=2),
      *_perm_rows("perm32", "copy/perm32"),
      *prefill_rows(),  # 192 MiB
      # 256 MiB.
      RowSpec("copy/b1x128k-fp8", "copy", "b1x128k-fp8", limit_s=30, est_s=2),
      *_layer_rows("b1x128k-fp8", (None,), copy_ref="copy/b1x128k-fp8",
                   check="check/attn-fp8"),
      *decode_variant_rows("b1x128k-fp8", "copy/b1x128k-fp8"),
      # 512 MiB.
      RowSpec("copy/b1x128k", "copy", "b1x128k", limit_s=30, est_s=2),
      RowSpec("builtin/b1x128k", "builtin", "b1x128k", limit_s=60, est_s=8,
              copy_ref="copy/b1x128k"),
      RowSpec("dense/b1x128k", "dense", "b1x128k", limit_s=45, est_s=4,
              copy_ref="copy/b1x128k", builtin_ref="builtin/b1x128k"),
      *_layer_rows("b1x128k", (None, *decode_impls), copy_ref="copy/b1x128k",
                   builtin_ref="builtin/b1x128k",
                   goals={"copy_pct": 70, "x_builtin": 1.5}),
      *block_size_rows("b1x128k"),  # the same 512 MiB at blocks 32 and 64
      *_perm_rows("perm256", "copy/b1x128k"),  # the same 512 MiB
      # 1 GiB.
      RowSpec("copy/b64x8k-fp8", "copy", "b64x8k-fp8", limit_s=30, est_s=2),
      *_layer_rows("b64x8k-fp8", (None,), copy_ref="copy/b64x8k-fp8", check="check/attn-fp8"),
      *_layer_rows("b64x8k-d64", (None,), copy_ref="copy/b64x8k-fp8"),  # 1 GiB too
      *decode_variant_rows("b64x8k-fp8", "copy/b64x8k-fp8"),
      *decode_variant_rows("b64x8k-d64", "copy/b64x8k-fp8"),
      # 1.9 GiB.
      RowSpec("copy/mixed", "copy", "mixed", limit_s=30, est_s=3),
      *_layer_rows("mixed", (None,), copy_ref="copy/mixed", limit=90, est=15),
      *mixed_mosaic_rows(),
      # 2 GiB.
      RowSpec("copy/b64x8k", "copy", "b64x8k", limit_s=30, est_s=3),
      RowSpec("builtin/b64x8k", "builtin", "b64x8k", limit_s=60, est_s=8,
              copy_ref="copy/b64x8k"),
      RowSpec("dense/b64x8k", "dense", "b64x8k", limit_s=45, est_s=5,
              copy_ref="copy/b64x8k", builtin_ref="builtin/b64x8k"),
      *_layer_rows("b64x8k", (None,), copy_ref="copy/b64x8k",
                   builtin_ref="builtin/b64x8k",
                   goals={"copy_pct": 85, "x_builtin": 1.5}, limit=75, est=12),
      *_layer_rows("b64x8k", decode_impls, copy_ref="copy/b64x8k",
                   builtin_ref="builtin/b64x8k", limit=75, est=12),
      *block_size_rows("b64x8k"),  # the same 2 GiB at blocks 32 and 64
      *_perm_rows("perm1024", "copy/b64x8k"),  # the same 2 GiB
      # 4 GiB.
      RowSpec("copy/b64x8k-d256", "copy", "b64x8k-d256", limit_s=30, est_s=3),
      *_layer_rows("b64x8k-d256", (None,), copy_ref="copy/b64x8k-d256", limit=75,
                   est=12),
      *serving_rows(),
  ]
  ids = [r.id for r in rows]
  assert len(set(ids)) == len(ids), "duplicate row ids"
  return rows


# Block-size rows ----------------------------------------------------------------

BLOCK_SIZE_ROWS = (32, 64)
"""Block sizes the main decode shapes are also timed at (block 16 is the main table's),
for `paged_kv.core.block_size.bandwidth_from_gpu_check`."""


def block_size_shapes(base: dict) -> dict:
  """`<key>-bs<B>`: the main decode shapes (`b64x8k`, `b1x128k`: D128 bf16) at each
  block size of `BLOCK_SIZE_ROWS`; same context, so the same bytes as at block 16
  (the contexts are multiples of every block size, in both modes)."""
  out = {}
  for key in ("b64x8k", "b1x128k"):
    for bs in BLOCK_SIZE_ROWS:
      shape = dataclasses.replace(base[key], block_size=bs)
      assert shape.nbytes == base[key].nbytes, (key, bs)
      out[f"{key}-bs{bs}"] = shape
  return out


def block_size_rows(key: str) -> list[RowSpec]:
  """The default decode path of shape `key` at each block size of `BLOCK_SIZE_ROWS`,
  against the block-16 shape's copy and built-in rows (same bytes). About 3.3 s each on
  an H200 (the block-16 rows' wall time in the 2026-12-04 run)."""
  return [RowSpec(f"layer/{key}-bs{bs}/default", "layer", f"{key}-bs{bs}", None, limit_s=60,
                  est_s=5, copy_ref=f"copy/{key}", builtin_ref=f"builtin/{key}",
                  needs=("check/attn/default",))
          for bs in BLOCK_SIZE_ROWS]


def row_shape(spec: RowSpec, dry: bool):
  return shapes(dry)[spec.key]


# Everything below runs in the worker (JAX imported) -----------------------------


class Wrong(Exception):
  """The row's numbers disagree with the reference (never timed)."""


class Skip(Exception):
  """The row cannot run here (e.g. JAX's built-in kernel is not importable)."""


@dataclasses.dataclass
class Result:
  us_per_call: float | None = None
  nbytes: int | None = None
  rel_err: float | None = None
  resolved_impl: str | None = None
  note: str = ""
  step_us: float | None = None  # serving rows: the scheduler step's p50


def _jax():
  import jax
  import jax.numpy as jnp
  return jax, jnp


def _dtype(name):
  _, jnp = _jax()
  return jnp.dtype(getattr(jnp, name))


def _interpret(dry):
  """`interpret=` for direct kernel calls: interpret mode on CPU only."""
  jax, _ = _jax()
  return bool(dry) and jax.default_backend() == "cpu"


class _Inject:
  """`GPU_CHECK_INJECT` faults for testing the driver: `wrong` perturbs the
  row's checked output so the comparison fails."""
  wrong = False


def _rel_err_rows(got, want) -> float:
  """Max over leading-axis entries of the relative L2 error (NaN if any
  output is not finite)."""
  import numpy as np
  got = np.asarray(got, np.float64).reshape(got.shape[0], -1)
  want = np.asarray(want, np.float64).reshape(want.shape[0], -1)
  if _Inject.wrong:
    got = got + 1.0
  if not np.all(np.isfinite(got)):
    return float("nan")
  num = np.linalg.norm(got - want, axis=1)
  den = np.maximum(np.linalg.norm(want, axis=1), 1e-30)
  return float(np.max(num / den)) if got.shape[0] else 0.0


def _require(err: float, what: str = "rel err"):
  if not err <= TOL:
    raise Wrong(f"{what} {err:.3g} > {TOL}")


def time_per_call(call, *, iters, repeats, warmup=True):
  """Median seconds per call of `call()` (which returns what to block on):
  `iters` calls back to back between two `block_until_ready`s, `repeats` times."""
  jax, _ = _jax()
  if warmup:
    jax.block_until_ready(call())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
      out = call()
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters)
  return statistics.median(times)


@functools.lru_cache(maxsize=None)
def _race_checker():
  """The Mosaic GPU interpreter's race record (dry mode only; private API)."""
  from pallas_kernels import lowering
  return lowering.interpreter_state()


def _mosaic_races(dry, impl, reset=False) -> bool:
  """Dry mode, impl "mosaic": reset (before) or read (after) the interpreter's
  race record. Never raises: the record is a private API."""
  if not (dry and impl == "mosaic"):
    return False
  try:
    mi = _race_checker()
    if reset:
      mi.reset_gpu_interpret_mode_state()
      return False
    return bool(mi.get_races().races_found)
  except Exception:  # pylint: disable=broad-except
    return False


# Segment tables (host, numpy) ----------------------------------------------------


@dataclasses.dataclass
class HostStep:
  """A step's tables on the host. Row b: `segments[b]` (block, start, length)
  list (None: padding row), `num_new[b]` new tokens = its last ones."""
  shape: AttnShape
  num_blocks: int
  segments: list
  num_new: list
  num_tokens: int
  max_query_len: int
  garbage: bool = False  # fill table entries past num_segments with junk
  used_blocks: set = dataclasses.field(default_factory=set)

  def token_slots(self, b):
    """(block i32[L], slot i32[L]) of row b's logical tokens."""
    import numpy as np
    blk, slot = [], []
    for (bl, st, ln) in self.segments[b]:
      blk += [bl] * ln
      slot += list(range(st, st + ln))
    return np.array(blk, np.int32), np.array(slot, np.int32)

  def arrays(self):
    """StepMetadata fields (numpy) and per-token info for the references."""
    import numpy as np
    bsz = len(self.segments)
    bs = self.shape.block_size
    s = max(len(x) for x in self.segments if x is not None)
    if self.garbage:
      s += 2
    seg = np.zeros((3, bsz, s), np.int32)
    if self.garbage:  # junk past num_segments: in-range blocks never used (NaN)
      free = sorted(set(range(self.num_blocks)) - self.used_blocks) or [0]
      rng = np.random.default_rng(7)
      seg[0] = rng.choice(free, size=(bsz, s))
      seg[2] = bs
    nseg = np.zeros((bsz,), np.int32)
    seq_lens = np.zeros((bsz,), np.int32)
    new = np.array([n if x is not None else 0 for x, n in zip(self.segments, self.num_new)],
                   np.int32)
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    t = self.num_tokens
    positions = np.full((t,), -1, np.int32)
    slot_mapping = np.full((t,), -1, np.int32)
    token_row = np.full((t,), -1, np.int32)
    for b, segs in enumerate(self.segments):
      if segs is None:
        continue
      nseg[b] = len(segs)
      seg[:, b, :len(segs)] = np.array(segs, np.int32).T
      n = sum(x[2] for x in segs)
      seq_lens[b] = n
      blk, slot = self.token_slots(b)
      for j in range(new[b]):
        p = n - new[b] + j
        positions[cu[b] + j] = p
        slot_mapping[cu[b] + j] = blk[p] * bs + slot[p]
        token_row[cu[b] + j] = b
    live = np.array([x is not None for x in self.segments])
    fields = dict(
        seq_ids=np.where(live, np.arange(bsz), -1).astype(np.int32),
        positions=positions, slot_mapping=slot_mapping, cu_q_lens=cu,
        seg_block=seg[0], seg_start=seg[1], seg_length=seg[2], num_segments=nseg,
        seq_lens=seq_lens,
        num_decodes=np.int32(np.sum(live & (new == 1))),
        num_prefills=np.int32(np.sum(live & (new > 1))))
    return fields, token_row


def _full_block_step(shape: AttnShape, seed: int) -> HostStep:
  """Decode rows then prefill rows, whole blocks scattered over the pool."""
  import numpy as np
  bs = shape.block_size
  num_blocks = int(shape.blocks_used * (1 + shape.slack)) + 1
  order = iter(np.random.default_rng(seed).permutation(num_blocks).tolist())
  segments, num_new = [], []
  lens = ([(shape.decode_ctx, 1)] * shape.decode_rows
          + [(shape.prefill_prefix + shape.prefill_chunk, shape.prefill_chunk)]
          * shape.prefill_rows)
  used = set()
  for n, k in lens:
    segs = []
    for i in range(-(-n // bs)):
      b = next(order)
      used.add(b)
      segs.append((b, 0, min(bs, n - i * bs)))
    segments.append(segs)
    num_new.append(k)
  return HostStep(shape, num_blocks, segments, num_new,
                  num_tokens=sum(num_new),
                  max_query_len=max(num_new) if shape.prefill_rows else 1,
                  used_blocks=used)


def _check_table(shape: AttnShape, seed: int) -> HostStep:
  """The correctness table: decodes and prefill chunks on a shared prefix cut
  inside a block, a slotted block (two rows' ranges in one block), a padding
  row, a long row (several splits), padding tokens, junk past num_segments."""
  import numpy as np
  bs = shape.block_size
  num_blocks = 64
  free = iter(np.random.default_rng(seed).permutation(num_blocks).tolist())
  a, b_, c, d, e, f, g, h = (next(free) for _ in range(8))
  long_blocks = [next(free) for _ in range(19)]
  half = bs // 2
  segments = [
      # 0: decode, 2.5 blocks (its new token at C slot half).
      [(a, 0, bs), (b_, 0, bs), (c, 0, half + 1)],
      # 1: 6-token chunk on row 0's first bs + 5 tokens (cut inside B).
      [(a, 0, bs), (b_, 0, 5), (d, 0, 10)],
      None,  # 2: padding row
      # 3: decode in the low half of slotted block E.
      [(e, 0, half)],
      # 4: a chunk of 11 on the high half of E (5 cached tokens).
      [(e, half, half - 3), (f, 0, 11)],
      # 5: a 20-token prefill from nothing.
      [(g, 0, bs), (h, 0, 4)],
      # 6: decode, 19 blocks, the last one partly filled.
      [(x, 0, bs) for x in long_blocks[:-1]] + [(long_blocks[-1], 0, 3)],
  ]
  num_new = [1, 6, 0, 1, 11, 20, 1]
  used = {a, b_, c, d, e, f, g, h, *long_blocks}
  n_real = sum(num_new)
  return HostStep(shape, num_blocks, segments, num_new, num_tokens=n_real + 3,
                  max_query_len=32, garbage=True, used_blocks=used)


def host_step(shape: AttnShape, seed: int = 0) -> HostStep:
  return _check_table(shape, seed) if shape.check_table else _full_block_step(shape, seed)


def _meta(fields, max_query_len):
  import jax.numpy as jnp

  from paged_kv.model.metadata import StepMetadata
  return StepMetadata(**{k: jnp.asarray(v) for k, v in fields.items()},
                      max_query_len=max_query_len)


def _resolved_default(shape: AttnShape, q_dtype):
  """What `impl=None` resolves to for decode here (new or old `default_impl`),
  and any fallback warning it gives."""
  jax, _ = _jax()
  from paged_kv.model import attention
  backend = jax.default_backend()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      impl = attention.default_impl(
          backend, num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
          head_dim=shape.head_dim, block_size=shape.block_size,
          dtype=_dtype(shape.dtype), q_dtype=q_dtype)
    except TypeError:  # the 0.2 `default_impl(backend)`: no shape arguments
      impl = attention.default_impl(backend)
  note = "; ".join(str(w.message) for w in caught)
  return impl, note


def _layer_step(impl, layer, **kw):
  """The jitted model-layer step, pages donated (the pool is updated in place);
  `kw`: more keyword arguments of `paged_attention` (`RowSpec.step_kw`)."""
  jax, _ = _jax()
  from paged_kv.model import attention

  def step(pages, q, k, v, meta):
    return attention.paged_attention(q, k, v, pages, layer, meta, impl=impl, **kw)

  return jax.jit(step, donate_argnums=(0,))


def _split_note(shape: AttnShape, step: HostStep) -> str:
  """The split-K factor `num_splits=None` picks here, when the kernels say."""
  try:
    from pallas_kernels import decode_attention as pa
    s = max(len(x) for x in step.segments if x is not None)
    n = pa.default_num_splits(batch=len(step.segments), num_kv_heads=shape.num_kv_heads,
                              num_seg_slots=s,
                              pages_per_step=pa.default_pages_per_step(shape.block_size),
                              block_size=shape.block_size)
    return f"default_num_splits={n}"
  except Exception:  # pylint: disable=broad-except  (an older kernel module)
    return ""


# Rows: correctness ---------------------------------------------------------------


def run_check_attn(spec: RowSpec, shape: AttnShape, *, dry, **_) -> Result:
  """The model layer on the check table against a float64 numpy reference that
  applies the write itself; the returned pages must equal the input pages with
  exactly the new tokens' slots written (bit for bit, NaNs included)."""
  jax, jnp = _jax()
  import numpy as np
  dt = _dtype(shape.dtype)
  st = host_step(shape, seed=1)
  fields, token_row = st.arrays()
  rng = np.random.default_rng(2)
  pshape = (shape.num_layers, shape.num_kv_heads, st.num_blocks, shape.block_size,
            shape.head_dim)
  pk = np.full(pshape, np.nan, np.float32)
  pv = np.full(pshape, np.nan, np.float32)
  bs = shape.block_size
  for b in range(len(st.segments)):  # fill every used slot except new tokens'
    if st.segments[b] is None:
      continue
    blk, slot = st.token_slots(b)
    old = len(blk) - st.num_new[b]
    for layer in range(shape.num_layers):
      pk[layer, :, blk[:old], slot[:old]] = rng.standard_normal(
          (old, shape.num_kv_heads, shape.head_dim))
      pv[layer, :, blk[:old], slot[:old]] = rng.standard_normal(
          (old, shape.num_kv_heads, shape.head_dim))
  t = st.num_tokens
  q = jnp.asarray(rng.standard_normal((t, shape.num_q_heads, shape.head_dim)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((t, shape.num_kv_heads, shape.head_dim)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((t, shape.num_kv_heads, shape.head_dim)), jnp.bfloat16)
  from paged_kv.core.state import KVPages
  pages = KVPages(k=jnp.asarray(pk, dt), v=jnp.asarray(pv, dt))
  pages_in = (np.asarray(pages.k), np.asarray(pages.v))  # in the page dtype
  meta = _meta(fields, st.max_query_len)
  resolved, note = (spec.impl, "") if spec.impl else _resolved_default(shape, jnp.bfloat16)
  _mosaic_races(dry, resolved, reset=True)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pages_out, out = jax.block_until_ready(
        _layer_step(spec.impl, shape.layer, **dict(spec.step_kw))(pages, q, k, v, meta))
  if _mosaic_races(dry, resolved):
    raise Wrong("the Mosaic GPU interpreter detected a race")
  # The pages: input + exactly the new tokens' K/V at their slots, bit for bit.
  sm = fields["slot_mapping"]
  live = sm >= 0
  for name, p_in, p_out, new in (("k", pages_in[0], pages_out.k, k),
                                 ("v", pages_in[1], pages_out.v, v)):
    want = p_in.copy()
    new_p = np.asarray(new.astype(dt))
    want[shape.layer, :, sm[live] // bs, sm[live] % bs] = new_p[live]
    got = np.asarray(p_out)
    if not np.array_equal(want.view(np.uint8), got.view(np.uint8)):
      raise Wrong(f"pages.{name} after the step differ from input + the step's writes")
  # The output: float64 causal attention over each row's logical K/V.
  kp = np.asarray(np.asarray(pages_out.k)[shape.layer], np.float64)
  vp = np.asarray(np.asarray(pages_out.v)[shape.layer], np.float64)
  qf = np.asarray(q, np.float64)
  group = shape.num_q_heads // shape.num_kv_heads
  want = np.zeros(qf.shape)
  for tok in range(t):
    b = token_row[tok]
    if b < 0:
      continue
    blk, slot = st.token_slots(b)
    p = fields["positions"][tok]
    kk, vv = kp[:, blk[:p + 1], slot[:p + 1]], vp[:, blk[:p + 1], slot[:p + 1]]
    qg = qf[tok].reshape(shape.num_kv_heads, group, shape.head_dim)
    s = np.einsum("hgd,hld->hgl", qg, kk) / math.sqrt(shape.head_dim)
    s = np.exp(s - s.max(-1, keepdims=True))
    want[tok] = (np.einsum("hgl,hld->hgd", s, vv) / s.sum(-1)[..., None]).reshape(
        shape.num_q_heads, shape.head_dim)
  got = np.asarray(out, np.float64)
  pad = token_row < 0
  if np.any(got[pad] != 0):
    raise Wrong("padding tokens' outputs are not 0")
  err = _rel_err_rows(got[~pad], want[~pad])
  _require(err)
  label = None if spec.impl else resolved
  return Result(rel_err=err, resolved_impl=label, note=note)


def run_check_perm(spec: RowSpec, shape: PermShape, *, dry, **_) -> Result:
  """`permute_blocks` with padding moves (middle and end) and a move count that
  is not a multiple of the Mosaic kernel's chunk, against numpy, bit for bit."""
  jax, jnp = _jax()
  import numpy as np

  from pallas_kernels import permute_blocks as pb
  rng = np.random.default_rng(3)
  pshape = (shape.num_layers, shape.num_kv_heads, shape.num_blocks, shape.block_size,
            shape.head_dim)
  pages = jnp.asarray(rng.standard_normal(pshape), _dtype(shape.dtype))
  perm = rng.permutation(shape.num_blocks)
  m = shape.num_moves
  src, dst = perm[:m].tolist(), perm[m:2 * m].tolist()
  for i in range(shape.num_padding):  # one in the middle, the rest at the end
    at = m // 2 if i == 0 else len(src)
    src.insert(at, -1 if i % 2 == 0 else int(perm[-1]))
    dst.insert(at, int(perm[-2]) if i % 2 == 0 else -1)
  src, dst = np.array(src, np.int32), np.array(dst, np.int32)
  before = np.asarray(pages)
  want = before.copy()
  live = (src >= 0) & (dst >= 0)
  want[:, :, dst[live]] = before[:, :, src[live]]
  _mosaic_races(dry, spec.impl, reset=True)
  out = jax.block_until_ready(pb.permute_blocks(
      pages, jnp.asarray(src), jnp.asarray(dst), impl=spec.impl,
      interpret=_interpret(dry)))
  if _mosaic_races(dry, spec.impl):
    raise Wrong("the Mosaic GPU interpreter detected a race")
  got = np.asarray(out)
  if _Inject.wrong:
    got = got + 1
  bad = int(np.sum(np.any(got.view(np.uint16) != want.view(np.uint16), axis=(0, 1, 3, 4))))
  if bad:
    raise Wrong(f"{bad} of {shape.num_blocks} blocks differ from the moves applied in numpy")
  return Result(rel_err=0.0)


# Rows: timings --------------------------------------------------------------------


def _normal(seed: int, shape, dtype):
  """Standard normal values in `dtype`, the same for the same seed and shape:
  drawn on the host (numpy) when small, on the device (`jax.random`) when not
  (gigabytes of pages; host drawing and the transfer would cost seconds)."""
  jax, jnp = _jax()
  import numpy as np
  if math.prod(shape) <= 1 << 22:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32),
                       dtype)
  return _device_normal(tuple(shape))(jax.random.key(seed)).astype(dtype)


@functools.lru_cache(maxsize=None)
def _device_normal(shape):
  """The jitted bf16 normal draw of `shape` (compiled once per shape)."""
  jax, jnp = _jax()
  return jax.jit(lambda key: jax.random.normal(key, shape, jnp.bfloat16))


def _pages(shape: AttnShape, num_blocks: int, *, layers, seed, unused=None):
  """K and V pages `[len(layers), KVH, num_blocks, bs, D]`: layer l of K (V) is
  `_normal` of its own seed, so one layer's pages are equal across the rows of
  a shape (the built-in row reads the layer rows' pages); blocks in `unused`
  are NaN."""
  _, jnp = _jax()
  dt = _dtype(shape.dtype)
  one = (shape.num_kv_heads, num_blocks, shape.block_size, shape.head_dim)
  out = []
  for which in (0, 1):
    p = jnp.stack([_normal(1000 * seed + 10 * which + l, one, dt) for l in layers])
    if unused is not None and len(unused):
      p = p.at[:, :, jnp.asarray(unused)].set(jnp.nan)
    out.append(p)
  return tuple(out)


def _attention_inputs(shape: AttnShape, *, seed=0):
  """(host step, fields, token_row, q, k, v) for a timing shape."""
  _, jnp = _jax()
  st = host_step(shape, seed=seed)
  fields, token_row = st.arrays()
  t = st.num_tokens
  q = _normal(seed + 11, (t, shape.num_q_heads, shape.head_dim), jnp.bfloat16)
  k = _normal(seed + 12, (t, shape.num_kv_heads, shape.head_dim), jnp.bfloat16)
  v = _normal(seed + 13, (t, shape.num_kv_heads, shape.head_dim), jnp.bfloat16)
  return st, fields, token_row, q, k, v


def _checked_rows(st: HostStep):
  """Rows the big-shape reference checks: first and last decode, first and last
  prefill."""
  dec = [b for b, n in enumerate(st.num_new) if n == 1]
  pre = [b for b, n in enumerate(st.num_new) if n > 1]
  return sorted({*dec[:1], *dec[-1:], *pre[:1], *pre[-1:]})


def _device_reference(st: HostStep, fields, kp, vp, q, rows, *, scale=None):
  """f32 causal attention, on device, of the new tokens of `rows` over their
  logical K/V read from one layer's pages `kp`, `vp` `[KVH, NB, bs, D]`.
  Returns (token indices, [n, H, D] float32)."""
  jax, jnp = _jax()
  import numpy as np
  shape = st.shape
  group = shape.num_q_heads // shape.num_kv_heads
  scale = 1 / math.sqrt(shape.head_dim) if scale is None else scale
  toks, outs = [], []
  cu = fields["cu_q_lens"]
  for b in rows:
    blk, slot = st.token_slots(b)
    idx = np.arange(cu[b], cu[b + 1])
    pos = jnp.asarray(fields["positions"][idx])
    kk = kp[:, jnp.asarray(blk), jnp.asarray(slot)].astype(jnp.float32)  # [KVH, L, D]
    vv = vp[:, jnp.asarray(blk), jnp.asarray(slot)].astype(jnp.float32)
    qg = q[jnp.asarray(idx)].astype(jnp.float32).reshape(len(idx), shape.num_kv_heads,
                                                         group, shape.head_dim)
    s = jnp.einsum("nhgd,hld->nhgl", qg, kk) * scale
    mask = jnp.arange(len(blk))[None, :] <= pos[:, None]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    o = jnp.einsum("nhgl,hld->nhgd", jax.nn.softmax(s, axis=-1), vv)
    toks.append(idx)
    outs.append(np.asarray(o.reshape(len(idx), shape.num_q_heads, shape.head_dim)))
  return np.concatenate(toks), np.concatenate(outs)


def run_layer(spec: RowSpec, shape: AttnShape, *, dry, iters, repeats) -> Result:
  """One Llama-shaped layer's step through `paged_kv.model.attention.paged_attention`
  (write the step's K/V + attend), the pool donated and chained call to call."""
  jax, jnp = _jax()
  import numpy as np

  from paged_kv.core.state import KVPages
  st, fields, _, q, k, v = _attention_inputs(shape)
  unused = sorted(set(range(st.num_blocks)) - st.used_blocks)
  pk, pv = _pages(shape, st.num_blocks, layers=range(shape.num_layers), seed=5,
                  unused=unused)
  pages = KVPages(k=pk, v=pv)
  meta = _meta(fields, st.max_query_len)
  resolved, note = (spec.impl, "") if spec.impl else _resolved_default(shape, jnp.bfloat16)
  step = _layer_step(spec.impl, shape.layer, **dict(spec.step_kw))
  _mosaic_races(dry, resolved, reset=True)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pages, out = jax.block_until_ready(step(pages, q, k, v, meta))
  if _mosaic_races(dry, resolved):
    raise Wrong("the Mosaic GPU interpreter detected a race")
  # Written slots, then the attention of the checked rows.
  rows = _checked_rows(st)
  toks, want = _device_reference(st, fields, pages.k[shape.layer], pages.v[shape.layer],
                                 q, rows)
  sm = fields["slot_mapping"][toks]
  bs = shape.block_size
  for name, p, new in (("k", pages.k, k), ("v", pages.v, v)):
    got = p[shape.layer][:, jnp.asarray(sm // bs), jnp.asarray(sm % bs)]
    exp = jnp.swapaxes(new[jnp.asarray(toks)].astype(p.dtype), 0, 1)
    if not bool(jnp.all(got == exp)):
      raise Wrong(f"the step's {name} was not written to its slots")
  err = _rel_err_rows(np.asarray(out[jnp.asarray(toks)], np.float32), want)
  _require(err)
  note = "; ".join(x for x in (note, _split_note(shape, st)) if x)
  state = {"pages": pages}

  def call():
    state["pages"], o = step(state["pages"], q, k, v, meta)
    return o

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    t = time_per_call(call, iters=iters, repeats=repeats, warmup=not dry)
  return Result(t * 1e6, shape.nbytes, err, None if spec.impl else resolved, note)


def run_builtin(spec: RowSpec, shape: AttnShape, *, dry, iters, repeats) -> Result:
  """JAX's built-in GPU paged attention (`jax.experimental.pallas.ops.gpu.
  paged_attention`, its defaults) on the same pages (layer `shape.layer` of
  the layer rows, one layer) and block tables as the layer rows."""
  try:
    from jax.experimental.pallas.ops.gpu import paged_attention as upstream
  except Exception as e:  # pylint: disable=broad-except
    raise Skip(f"not importable here: {type(e).__name__}: {e}") from e
  jax, jnp = _jax()
  import numpy as np
  st, fields, _, q, _, _ = _attention_inputs(shape)
  unused = sorted(set(range(st.num_blocks)) - st.used_blocks)
  kp, vp = _pages(shape, st.num_blocks, layers=[shape.layer], seed=5, unused=unused)
  kp, vp = kp[0], vp[0]
  pages_per_seq = fields["seg_block"].shape[1]
  block_tables = jnp.asarray(fields["seg_block"])
  lengths = jnp.asarray(fields["seq_lens"])
  k_splits = math.gcd(16, pages_per_seq)  # its default, if it divides the table
  scale = 1 / math.sqrt(shape.head_dim)
  qd = jnp.asarray(q)  # decode rows only (the timing shapes have no prefill here)

  @jax.jit
  def fn(qd, kp, vp, block_tables, lengths):
    qs = (qd * scale).astype(qd.dtype)  # it does not scale the logits itself
    return upstream.paged_attention(qs, kp, vp, block_tables, lengths,
                                    k_splits=k_splits, interpret=_interpret(dry))

  out = jax.block_until_ready(fn(qd, kp, vp, block_tables, lengths))
  rows = _checked_rows(st)
  toks, want = _device_reference(st, fields, kp, vp, q, rows)
  err = _rel_err_rows(np.asarray(out[jnp.asarray(toks)], np.float32), want)
  _require(err)
  t = time_per_call(lambda: fn(qd, kp, vp, block_tables, lengths), iters=iters,
                    repeats=repeats, warmup=not dry)
  return Result(t * 1e6, shape.nbytes, err, note=f"k_splits={k_splits}")


def run_dense(spec: RowSpec, shape: AttnShape, *, dry, iters, repeats) -> Result:
  """`jax.nn.dot_product_attention` over contiguous K/V of the same bytes."""
  jax, jnp = _jax()
  import numpy as np
  del spec
  b, n = shape.decode_rows, shape.decode_ctx
  dt = _dtype(shape.dtype)
  q = _normal(91, (b, 1, shape.num_q_heads, shape.head_dim), jnp.bfloat16)
  k = _normal(92, (b, n, shape.num_kv_heads, shape.head_dim), dt)
  v = _normal(93, (b, n, shape.num_kv_heads, shape.head_dim), dt)
  fn = jax.jit(jax.nn.dot_product_attention)
  out = jax.block_until_ready(fn(q, k, v))
  rows = sorted({0, b - 1})
  group = shape.num_q_heads // shape.num_kv_heads
  qf = q[jnp.asarray(rows), 0].astype(jnp.float32).reshape(len(rows), shape.num_kv_heads,
                                                           group, shape.head_dim)
  kf = k[jnp.asarray(rows)].astype(jnp.float32)
  vf = v[jnp.asarray(rows)].astype(jnp.float32)
  s = jnp.einsum("bhgd,blhd->bhgl", qf, kf) / math.sqrt(shape.head_dim)
  want = jnp.einsum("bhgl,blhd->bhgd", jax.nn.softmax(s, axis=-1), vf)
  err = _rel_err_rows(np.asarray(out[jnp.asarray(rows), 0], np.float32),
                      np.asarray(want.reshape(len(rows), shape.num_q_heads, -1)))
  _require(err)
  t = time_per_call(lambda: fn(q, k, v), iters=iters, repeats=repeats, warmup=not dry)
  return Result(t * 1e6, 2 * b * n * shape.num_kv_heads * shape.head_dim * dt.itemsize,
                err, note="contiguous K/V")


def run_copy(spec: RowSpec, shape, *, dry, iters, repeats) -> Result:
  """A plain device copy (`x + 1`, bf16) moving `shape.nbytes` bytes (read +
  written), cycling through buffers that add up to >= 256 MiB (past the L2)."""
  jax, jnp = _jax()
  del spec
  n = max(1, shape.nbytes // 4)  # bf16 elements: read n*2 + write n*2 bytes
  bufs = max(1, min(16, (256 << 20) // (2 * n * 2))) if not dry else 1
  xs = [_normal(100 + i, (n,), jnp.bfloat16) for i in range(bufs)]
  fn = jax.jit(lambda x: x + jnp.ones((), x.dtype))
  out = jax.block_until_ready(fn(xs[0]))
  err = _rel_err_rows(jnp.asarray(out, jnp.float32)[None, :1024],
                      (xs[0].astype(jnp.float32) + 1)[None, :1024])
  _require(err)
  state = {"i": 0}

  def call():
    state["i"] += 1
    return fn(xs[state["i"] % bufs])

  t = time_per_call(call, iters=iters, repeats=repeats, warmup=not dry)
  return Result(t * 1e6, 4 * n, note=f"{bufs} buffer(s) of {2 * n / 2**20:.1f} MiB")


_MOVE_SETS = 8  # random move sets a permutation row cycles through


def run_perm(spec: RowSpec, shape: PermShape, *, dry, iters, repeats) -> Result:
  """`permute_blocks` on a donated pool, chained, cycling through move sets
  spread over the pool; the first call is checked (moved blocks equal their
  sources, every other block unchanged)."""
  jax, jnp = _jax()
  import numpy as np

  from pallas_kernels import permute_blocks as pb
  pshape = (shape.num_layers, shape.num_kv_heads, shape.num_blocks, shape.block_size,
            shape.head_dim)
  pages = _normal(shape.num_moves, pshape, jnp.bfloat16)
  rng = np.random.default_rng(shape.num_moves)
  sets = []
  for _ in range(1 if dry else _MOVE_SETS):
    perm = rng.permutation(shape.num_blocks)
    m = shape.num_moves
    sets.append((jnp.asarray(perm[:m], jnp.int32), jnp.asarray(perm[m:2 * m], jnp.int32)))
  interp = _interpret(dry)
  fn = functools.partial(pb.permute_blocks, impl=spec.impl, interpret=interp)
  src, dst = sets[0]
  _mosaic_races(dry, spec.impl, reset=True)
  out = jax.block_until_ready(fn(jnp.copy(pages), src, dst))
  if _mosaic_races(dry, spec.impl):
    raise Wrong("the Mosaic GPU interpreter detected a race")
  keep = jnp.ones((shape.num_blocks,), bool).at[dst].set(False)
  moved_ok = jnp.array_equal(out[:, :, dst], pages[:, :, src])
  kept_ok = jnp.all(jnp.where(keep[None, None, :, None, None], out == pages, True))
  if _Inject.wrong:
    moved_ok = False
  if not (bool(moved_ok) and bool(kept_ok)):
    raise Wrong("moved blocks differ from their sources" if not bool(moved_ok)
                else "blocks outside the moves changed")
  del pages
  state = {"pages": out, "i": 0}

  def call():
    s, d = sets[state["i"] % len(sets)]
    state["i"] += 1
    state["pages"] = fn(state["pages"], s, d)
    return state["pages"]

  t = time_per_call(call, iters=iters, repeats=repeats, warmup=not dry)
  return Result(t * 1e6, shape.nbytes, 0.0)


# Rows: serving ----------------------------------------------------------------------


SERVING_DIR_ENV = "GPU_CHECK_SERVING_DIR"
"""Set by the driver in dry mode: the serving rows' folder, removed when it ends."""


class _Serving:
  """What the serving rows build once per worker and share: the checkpoint, the
  model, the executor, one warm scheduler per loop and the outputs served so far. A
  fresh worker (after a failed row) loads the checkpoint again; a timed row whose
  loop's warm-up row did not run in it skips."""
  root = None
  path = None
  ckpt = None
  executor = None
  pool_config = None
  scheds: dict = {}
  next_id: dict = {}
  outputs: dict = {}
  notes: dict = {}


def _serving_root(dry):
  """Where the checkpoint (and, on a GPU, JAX's compilation cache) live: a fixed
  folder under the temp dir on a GPU (a fresh worker, or a second run, reuses them),
  the driver's own temporary one in dry mode (`SERVING_DIR_ENV`, removed at its end).
  Never under $OUT (2.5 GB would travel back)."""
  import pathlib
  import tempfile
  del dry
  if _Serving.root is None:
    _Serving.root = pathlib.Path(os.environ.get(SERVING_DIR_ENV) or (
        pathlib.Path(tempfile.gettempdir()) / "paged_kv_gpu_check"))
  return _Serving.root


def _serving_model(shape: ServingShape, dry):
  """The checkpoint, written (or found complete) and loaded once per worker."""
  import json
  from paged_kv.model import hf_checkpoint, random_checkpoint
  from paged_kv.runtime import compile_cache
  if _Serving.ckpt is not None:
    return _Serving.ckpt
  root = _serving_root(dry)
  if not dry:
    compile_cache.enable_compilation_cache(str(root / "jax_cache"))
  hf = random_checkpoint.hf_config(shape.model, dtype=shape.dtype)
  path = root / f"{shape.model}-{shape.dtype}-seed0"
  t0 = time.perf_counter()
  config = path / "config.json"
  reused = config.is_file() and json.loads(config.read_text()) == hf
  if not reused:
    random_checkpoint.write_random_checkpoint(path, hf, seed=0)
  write_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  _Serving.ckpt = hf_checkpoint.load_checkpoint(
      path, max_seq_len=shape.prompt_len + shape.output_len)
  _Serving.path = path
  _Serving.notes["checkpoint"] = (
      f"{random_checkpoint.num_parameters(hf):,} parameters, "
      f"{'found' if reused else f'written in {write_s:.1f} s'}, loaded in "
      f"{time.perf_counter() - t0:.1f} s")
  return _Serving.ckpt


def _serving_workload(shape: ServingShape):
  """Batch `shape.batch`'s prompts: the same for both loops, none shared with the
  other batch (no prefix-cache hits from another row)."""
  from paged_kv.sim import workload
  vocab = shape.hf_config["vocab_size"]
  return workload.random_workload(shape.num_requests, shape.prompt_len, shape.output_len,
                                  vocab, seed=1 + shape.batch)


def _serving_sched(shape: ServingShape, dry, loop: str, *, build: bool):
  """The warm scheduler of `loop`; with `build`, made and warmed (once per worker)
  over the one executor every loop shares (so they share programs)."""
  from paged_kv.sim import serving_bench as sb
  from paged_kv.sim import workload
  from paged_kv.scheduler.executor import ModelExecutor
  from paged_kv.scheduler.scheduler import SchedulerConfig
  if loop in _Serving.scheds:
    return _Serving.scheds[loop]
  if not build:
    raise Skip(f"the {loop} loop's warm-up row did not run in this worker")
  ckpt = _serving_model(shape, dry)
  max_len = shape.prompt_len + shape.output_len
  if _Serving.executor is None:
    _Serving.pool_config = sb.serving_pool_config(
        ckpt.config, max_batch=shape.max_batch, max_seq_len=max_len,
        block_size=shape.block_size)
    _Serving.executor = ModelExecutor(ckpt.model, _Serving.pool_config)
  sched = sb.build_scheduler(_Serving.executor, _Serving.pool_config, SchedulerConfig(
      max_batch=shape.max_batch, prefill_chunk=shape.prefill_chunk,
      prefill_token_budget=shape.prefill_budget, compaction=None,
      overlap=dict(SERVING_LOOPS)[loop], max_seq_len=max_len))
  # Warmed by serving: an untimed pass of every batch's workload shape compiles the
  # programs the timed rows run (Scheduler.warmup() would compile every bucket).
  from paged_kv.runtime import counters
  t0, next_id = time.perf_counter(), 0
  compiles, loads = counters.backend_compiles(), counters.cache_loads()
  vocab = shape.hf_config["vocab_size"]
  for s in _serving_shapes(dry).values():
    if s.batch:
      wl = workload.shadow_workload(_serving_workload(s), vocab, seed=20_000 + s.batch)
      sb.run_closed_loop(sched, wl, s.batch, first_id=next_id)
      next_id += len(wl)
  _Serving.notes[f"warmup-{loop}"] = (
      f"served each batch's workload shape untimed: {next_id} requests, "
      f"{counters.backend_compiles() - compiles} compiles, "
      f"{counters.cache_loads() - loads} from the persistent cache, "
      f"{time.perf_counter() - t0:.1f} s")
  _Serving.scheds[loop] = sched
  _Serving.next_id[loop] = next_id
  return sched


def run_serving_checkpoint(spec: RowSpec, shape: ServingShape, *, dry, **_) -> Result:
  """Writes the random checkpoint (or finds it) and loads it with `load_checkpoint`."""
  del spec
  _serving_model(shape, dry)
  return Result(note=_Serving.notes["checkpoint"])


def run_serving_warmup(spec: RowSpec, shape: ServingShape, *, dry, **_) -> Result:
  """The loop `spec.impl`'s scheduler, warmed by serving each batch's workload shape
  once untimed (other prompts of the same lengths)."""
  _serving_sched(shape, dry, spec.impl, build=True)
  return Result(note=_Serving.notes[f"warmup-{spec.impl}"])


def run_serving_device(spec: RowSpec, shape: ServingShape, *, dry, **_) -> Result:
  """The device's own decode step for the batch: `PagedRunner.decode`, 16 steps per
  jitted call (`decode_multi`), no scheduler; then one more call traced by JAX's
  profiler: the step's device time per op (issue U item 5) in the note."""
  from paged_kv.sim import serving_bench as sb
  del spec
  ckpt = _serving_model(shape, dry)
  prompts = _serving_workload(shape).prompts[:shape.batch]
  step = sb.device_step(ckpt.model, prompts, block_size=shape.block_size,
                        steps_per_call=16, calls=1 if dry else 4,
                        prefill_chunk=shape.prefill_chunk, profile=True)
  return Result(us_per_call=1e6 * step.seconds, nbytes=shape.nbytes,
                note=f"PagedRunner.decode, 16 steps per call, batch {shape.batch}; "
                     + step.ops_summary("step"))


def run_serving_prefill(spec: RowSpec, shape: ServingShape, *, dry, **_) -> Result:
  """One prefill chunk of `shape.prompt_len` new tokens through the model on an empty
  row (`PagedRunner.prefill`), then the same traced by JAX's profiler: tokens/s, the
  model's matmul FLOP rate (2 x parameters read per token; attention's FLOPs not
  counted) and the per-op breakdown (issue U item 5)."""
  from paged_kv.sim import serving_bench as sb
  del spec
  ckpt = _serving_model(shape, dry)
  hf = shape.hf_config
  step = sb.prefill_step(ckpt.model, shape.prompt_len, vocab=hf["vocab_size"],
                         block_size=shape.block_size)
  tokens = shape.prompt_len
  flops = 2 * shape.weight_bytes // (4 if shape.dtype == "float32" else 2) * tokens
  return Result(us_per_call=1e6 * step.seconds,
                note=f"{tokens} new tokens: {tokens / step.seconds:,.0f} tok/s, "
                     f"{flops / step.seconds / 1e12:.1f} TFLOP/s of weight matmuls; "
                     + step.ops_summary("chunk"))


def run_serving(spec: RowSpec, shape: ServingShape, *, dry, **_) -> Result:
  """`batch` requests in flight through the loop `spec.impl` (warmed by its warm-up
  row). us/call: wall time per `batch` output tokens (so `% copy`
  is the share of the bandwidth ceiling reached); step p50 in `step_us`."""
  from paged_kv.sim import serving_bench as sb
  loop = spec.impl
  sched = _serving_sched(shape, dry, loop, build=False)
  wl = _serving_workload(shape)
  res = sb.run_closed_loop(sched, wl, shape.batch, first_id=_Serving.next_id[loop])
  _Serving.next_id[loop] += len(wl)
  _Serving.outputs[shape.batch, loop] = res.outputs
  other, other_out = next(((l, o) for (b, l), o in _Serving.outputs.items()
                           if b == shape.batch and l != loop), (None, None))
  if other_out is not None and other_out != res.outputs:
    bad = sum(a != b for a, b in zip(other_out, res.outputs))
    raise Wrong(f"{bad} of {len(other_out)} requests' tokens differ from the {other} loop's")
  f = res.figures()
  note = (f"{f['tokens_per_s']:,.0f} tok/s; step {f['step_p50_ms']:.2f}/{f['step_p90_ms']:.2f}"
          f" ms (p50/p90)" + (f"; tokens = {other}" if other is not None else "")
          + f"; TTFT {f['ttft_p50_ms']:.1f}/{f['ttft_p99_ms']:.1f} ms, TPOT "
          f"{f['tpot_p50_ms']:.2f}/{f['tpot_p99_ms']:.2f} ms (p50/p99); {f['steps']} steps, "
          f"{f['compiles']} compiles, {f['host_reads_per_step']:.2f} reads/step")
  return Result(us_per_call=1e6 * shape.batch / res.tokens_per_s, nbytes=shape.nbytes,
                step_us=1e3 * f["step_p50_ms"], note=note)


def run_serving_hf(spec: RowSpec, shape: ServingShape, *, dry, **_) -> Result:
  """The served tokens against transformers on the same checkpoint: its greedy
  `generate` (requests equal in full) and teacher-forced (each token transformers'
  argmax given our sequence, near-ties allowed); wrong tokens fail the row."""
  from paged_kv.model import hf_reference
  from paged_kv.sim import serving_bench as sb
  del spec
  why = hf_reference.available()
  if why:
    raise Skip(why)
  served = {}
  for (b, loop), out in _Serving.outputs.items():
    served.setdefault(b, (loop, out))
  if not served:
    raise Skip("no serving row ran in this worker")
  _serving_model(shape, dry)
  ref = hf_reference.Reference(_Serving.path)
  n = 4 if dry else 16
  workloads = {b: _serving_workload(dataclasses.replace(shape, batch=b,
                                                        num_requests=len(outs)))
               for b, (_, outs) in served.items()}
  verdicts, rate = sb.compare_with_reference(
      ref, {b: w.prompts for b, w in workloads.items()},
      {b: w.output_lens for b, w in workloads.items()},
      {(b, loop): outs[:n] for b, (loop, outs) in served.items()})
  ref.close()
  tokens = sum(v["tokens"] for v in verdicts.values())
  off = [(b, *x) for (b, _), v in sorted(verdicts.items()) for x in v["off"]]
  num_off = sum(v["tokens_off"] for v in verdicts.values())
  parts = [f"batch {b} ({loop}): {v['equal']}/{v['compared']}"
           for (b, loop), v in sorted(verdicts.items())]
  note = (f"transformers {ref.version} ({ref.device}, {ref.dtype}): greedy generate equal in "
          f"full for {', '.join(parts)} requests; teacher-forced {tokens - num_off}/{tokens} "
          f"tokens its argmax (ties <= 0.1 std); generate {rate:,.0f} tok/s")
  if num_off:
    raise Wrong(f"{num_off} of {tokens} tokens are not transformers' argmax (first: batch "
                f"{off[0][0]} request {off[0][1]} position {off[0][2]}, {off[0][3]:.2f} std); "
                f"{note}")
  return Result(rel_err=num_off / max(tokens, 1), note=note)


COLD_START_GOALS = {"cold": 20.0, "cache": 5.0}
"""Issue V's warm-up goals on a GPU, seconds (Llama-3.2-1B shape, batch 64)."""


def run_serving_cold_start(spec: RowSpec, shape: ServingShape, *, dry, **_) -> Result:
  """Two fresh processes (`paged_kv.sim.cold_start.measure`) on the row's
  checkpoint: a cold start on an empty persistent compilation cache, then a restart
  on that cache, which must compile nothing (else `Wrong`). The note: seconds from
  each launch to the first token, and `Scheduler.warmup()`'s seconds, programs,
  compiles and loads, against issue V's goals."""
  import shutil
  from paged_kv.sim import cold_start
  del spec
  _serving_model(shape, dry)  # written (or found) by the checkpoint row's worker
  cache = _serving_root(dry) / "cold_start_cache"
  shutil.rmtree(cache, ignore_errors=True)
  parts, runs = [], {}
  try:
    for mode in ("cold", "cache"):
      runs[mode] = r = cold_start.measure(cold_start.ColdStartSpec(
          checkpoint=str(_Serving.path), max_batch=shape.max_batch,
          max_seq_len=shape.prompt_len + shape.output_len, prefill_chunk=shape.prefill_chunk,
          prefill_token_budget=shape.prefill_budget, prompt_len=shape.prompt_len,
          cache_dir=str(cache)))
      met = "met" if r["warmup_s"] <= COLD_START_GOALS[mode] else "MISSED"
      parts.append(f"{mode}: first token {r['first_token']:.1f} s, warm-up "
                   f"{r['warmup_s']:.1f} s (goal <= {COLD_START_GOALS[mode]:.0f} s: {met}; "
                   f"{r['programs']} programs, {r['compiles']} compiled, "
                   f"{r['cache_loads']} loaded)")
  finally:
    shutil.rmtree(cache, ignore_errors=True)
  note = f"max_batch {shape.max_batch}; " + "; ".join(parts)
  if runs["cache"]["compiles"]:
    raise Wrong(f"the restart on the warm cache compiled {runs['cache']['compiles']} "
                f"programs; {note}")
  return Result(note=note)


RUNNERS = {"check_attn": run_check_attn, "check_perm": run_check_perm, "copy": run_copy,
           "builtin": run_builtin, "dense": run_dense, "layer": run_layer,
           "perm": run_perm, "serving_checkpoint": run_serving_checkpoint,
           "serving_warmup": run_serving_warmup, "serving_device": run_serving_device,
           "serving": run_serving, "serving_prefill": run_serving_prefill,
           "serving_hf": run_serving_hf,
           "serving_cold_start": run_serving_cold_start}


def run_row(spec: RowSpec, *, dry: bool, iters: int, repeats: int,
            inject: str | None = None) -> Result:
  """Runs one row; raises Wrong / Skip / whatever the API raised."""
  _Inject.wrong = inject == "wrong"
  if inject == "hang":
    while True:
      time.sleep(3600)
  if inject == "raise":
    raise RuntimeError("injected failure (GPU_CHECK_INJECT)")
  if inject == "crash":
    os.abort()
  shape = row_shape(spec, dry)
  return RUNNERS[spec.kind](spec, shape, dry=dry, iters=iters, repeats=repeats)


# Decode-kernel variants (issue U) ---------------------------------------------------

# Candidates timed side by side at the kernel's own API, per shape key:
# (impl, pages_per_step). The 2026-12-04 defaults were ("mosaic", 4) at D64 (48%
# of copy) and ("pallas", 4) for fp8 (55% / 43%); the stage widths that carry a
# D128 bf16 step's bytes (8 pages of 16 tokens at D64 and fp8) and the Mosaic
# kernel's fp8 pages (staged to f16 in shared memory) are the new candidates.
DECODE_VARIANTS = {
    "b1x128k-fp8": (("pallas", 4), ("pallas", 8), ("mosaic", 4)),
    "b64x8k-fp8": (("pallas", 4), ("pallas", 8), ("mosaic", 4)),
    "b64x8k-d64": (("mosaic", 4), ("mosaic", 8), ("pallas", 8)),
}
# Dry mode runs the Triton rows of this key only (the runner is the same for
# every row; the Mosaic variants' numbers are checked in the GPU interpreter by
# tests/kernels/test_mosaic_attention.py, at a cost the dry budget has no room for).
DRY_VARIANT_KEY = "b64x8k-fp8"


def decode_variant_rows(key: str, copy_ref: str) -> list[RowSpec]:
  """`kernel/<key>/<impl>-pps<n>` rows of `DECODE_VARIANTS[key]`: the decode
  kernel alone (`run_decode_kernel`, which checks its numbers before timing).
  Each needs its impl's check row (fp8 through Triton: the fp8 default path's);
  Mosaic with fp8 pages has none (its first row, at b1x128k-fp8, is the check
  the later one needs), so a hang costs one row's limit, not one per row."""
  fp8 = key.endswith("-fp8")
  rows = []
  for impl, pps in DECODE_VARIANTS[key]:
    if fp8 and impl == "mosaic":
      first = f"kernel/b1x128k-fp8/{impl}-pps{pps}"
      needs = ("check/attn/mosaic",) + ((first,) if key != "b1x128k-fp8" else ())
    else:
      needs = ("check/attn-fp8/default" if fp8 else f"check/attn/{impl}",)
    rows.append(RowSpec(f"kernel/{key}/{impl}-pps{pps}", "decode_kernel", key, impl,
                        limit_s=45, est_s=4, copy_ref=copy_ref, needs=needs,
                        pages_per_step=pps))
  return rows


def run_decode_kernel(spec: RowSpec, shape: AttnShape, *, dry, iters, repeats) -> Result:
  """`pallas_kernels.decode_attention.paged_attention` alone on a decode-only
  shape: the pool's stacked pages read at `shape.layer` in place, the tables of
  the layer rows, `impl=spec.impl`, `pages_per_step=spec.pages_per_step`,
  `num_splits=None`; checked against the layer rows' f32 reference, then timed.
  Dry mode: only the Triton rows of `DRY_VARIANT_KEY` run."""
  if dry and (spec.impl != "pallas" or spec.key != DRY_VARIANT_KEY):
    raise Skip(f"dry mode runs kernel/{DRY_VARIANT_KEY}/pallas-* only")
  jax, jnp = _jax()
  import numpy as np

  from pallas_kernels import decode_attention as pa
  st, fields, _, q, _, _ = _attention_inputs(shape)
  if st.max_query_len != 1:
    raise Skip("decode-only shapes: the kernel takes one query per row")
  unused = sorted(set(range(st.num_blocks)) - st.used_blocks)
  pk, pv = _pages(shape, st.num_blocks, layers=range(shape.num_layers), seed=5,
                  unused=unused)
  table = [jnp.asarray(fields[f]) for f in ("seg_block", "seg_start", "seg_length",
                                            "num_segments")]
  fn = jax.jit(functools.partial(pa.decode_attention, impl=spec.impl,
                                 pages_per_step=spec.pages_per_step,
                                 interpret=_interpret(dry), layer=shape.layer))
  _mosaic_races(dry, spec.impl, reset=True)
  out = jax.block_until_ready(fn(q, pk, pv, *table))
  if _mosaic_races(dry, spec.impl):
    raise Wrong("the Mosaic GPU interpreter detected a race")
  rows = _checked_rows(st)
  toks, want = _device_reference(st, fields, pk[shape.layer], pv[shape.layer], q, rows)
  err = _rel_err_rows(np.asarray(out[jnp.asarray(toks)], np.float32), want)
  _require(err)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    t = time_per_call(lambda: fn(q, pk, pv, *table), iters=iters, repeats=repeats,
                      warmup=not dry)
  return Result(t * 1e6, shape.nbytes, err, None,
                f"pages_per_step={spec.pages_per_step}; {_split_note(shape, st)}")


RUNNERS["decode_kernel"] = run_decode_kernel

# Prefill and mixed-step rows (issue U, item 4) -----------------------------------------

PREFILL_TFLOPS_GOAL = 350  # issue U: causal attention FLOPs per second, 8 x 2,048 new


def prefill_check_rows() -> list[RowSpec]:
  """The check table through the model layer with the Mosaic GPU kernels for decode
  and prefill rows alike (`check/attn/mosaic` keeps Triton's prefill kernel, so a
  fault of the new prefill kernel skips only the rows that need this one)."""
  return [RowSpec("check/attn/mosaic-prefill", "check_attn", "check", "mosaic", 60,
                  est_s=10)]


def prefill_rows() -> list[RowSpec]:
  """The prefill kernel alone at 8 rows x 2,048 new tokens on 4,096 cached (D128),
  the Triton kernel and the Mosaic GPU one side by side; their note gives TFLOP/s
  of causal attention FLOPs (`causal_flops`) against the goal."""
  return [RowSpec(f"prefill/prefill8x2k/{impl}", "prefill", "prefill8x2k", impl,
                  limit_s=60, est_s=10,
                  needs=("check/attn/mosaic-prefill" if impl == "mosaic" else
                         "check/attn/pallas",))
          for impl in ("pallas", "mosaic")]


def mixed_mosaic_rows() -> list[RowSpec]:
  """The mixed step (56 decode + 8 prefill rows) in one launch of the Mosaic GPU
  prefill kernel (`mixed_launches=1`: decode rows as one-token tiles), beside
  `layer/mixed/default` (Mosaic decode, then Triton prefill). The two-launch
  variant with the Mosaic prefill kernel (`impl="mosaic"`) is left out: in dry
  mode it interprets both Mosaic kernels (25-50 s on a 2-core CPU), more than the
  dry budget has room for; `gpu_check.sh --only=...` cannot add it either, so a
  GPU session that wants it runs `paged_attention(impl="mosaic")` itself."""
  return [
      RowSpec("layer/mixed/mosaic-1launch", "layer", "mixed", "mosaic", limit_s=90,
              est_s=12, copy_ref="copy/mixed", step_kw=(("mixed_launches", 1),),
              needs=("check/attn/mosaic-prefill",)),
  ]


def causal_flops(shape: AttnShape) -> int:
  """FLOPs of the prefill rows' causal attention: per new token at logical
  position p, p + 1 keys, each 2 x head_dim for Q K^T and 2 x head_dim for P V,
  per query head (masked work a kernel does anyway is not counted)."""
  n, c = shape.prefill_chunk, shape.prefill_prefix
  keys = n * c + n * (n + 1) // 2  # sum over the chunk of (position + 1)
  return 4 * shape.head_dim * shape.num_q_heads * shape.prefill_rows * keys


def run_prefill(spec: RowSpec, shape: AttnShape, *, dry, iters, repeats) -> Result:
  """`pallas_kernels.prefill_attention.prefill_attention` alone (stacked pool, a
  traced layer; the new tokens' K/V already in the pages), checked on its first
  and last row against the f32 device reference, then timed."""
  jax, jnp = _jax()
  import numpy as np

  from pallas_kernels import prefill_attention as pf
  st, fields, _, q, _, _ = _attention_inputs(shape)
  unused = sorted(set(range(st.num_blocks)) - st.used_blocks)
  kp, vp = _pages(shape, st.num_blocks, layers=range(shape.num_layers), seed=5,
                  unused=unused)
  tables = [jnp.asarray(fields[k]) for k in ("cu_q_lens", "seg_block", "seg_start",
                                             "seg_length", "num_segments")]
  interpret = _interpret(dry)
  fn = jax.jit(lambda layer, q, kp, vp, *t: pf.prefill_attention(
      q, kp, vp, *t, impl=spec.impl, interpret=interpret, layer=layer))
  layer = jnp.int32(shape.layer)
  _mosaic_races(dry, spec.impl, reset=True)
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(layer, q, kp, vp, *tables))
  first_s = time.perf_counter() - t0
  if _mosaic_races(dry, spec.impl):
    raise Wrong("the Mosaic GPU interpreter detected a race")
  toks, want = _device_reference(st, fields, kp[shape.layer], vp[shape.layer], q,
                                 _checked_rows(st))
  err = _rel_err_rows(np.asarray(out[jnp.asarray(toks)], np.float32), want)
  _require(err)
  if dry:  # interpret mode: the checked call's time, compile included (meaningless)
    t = first_s
  else:
    t = time_per_call(lambda: fn(layer, q, kp, vp, *tables), iters=iters,
                      repeats=repeats)
  tflops = causal_flops(shape) / t / 1e12
  met = "met" if tflops >= PREFILL_TFLOPS_GOAL else "MISSED"
  return Result(t * 1e6, shape.nbytes, err, note=(
      f"{tflops:.3g} TFLOP/s causal ({causal_flops(shape):,} FLOP; goal >= "
      f"{PREFILL_TFLOPS_GOAL}: {met})"))


RUNNERS.update(prefill=run_prefill)

"""The timed GPU check, one row at a time, each appended to a table as it ends.

Usage:
  PYTHONPATH=. python3 tools/gpu_check.py --out=$OUT/table.md --deadline_s=400
  JAX_PLATFORMS=cpu PYTHONPATH=. python3 tools/gpu_check.py --dry --out=/tmp/t.md

`tools/gpu_check.sh` runs it twice: `--dry` first on the CPU (every row lowered
for `cuda` against an abstract H200 at the real shapes, costing no GPU time),
then timed on the GPU.

Rows, cheapest first, each in its own try/except (a failure is a row of the
table, never the end of it), each appended and flushed to `--out` as soon as it
ends, none started past the global deadline:
  1. copy bandwidth: a large device-to-device elementwise copy (read + write);
  2. decode attention at batch 64 x 8k and batch 1 x 128k (32/8 heads, D=128,
     bf16, block 16, scattered blocks): every impl that builds here
     (`lowerable_decode_impls`), JAX's built-in
     `jax.experimental.pallas.ops.gpu.paged_attention` on the same pages as a
     page table, and a dense reference (`jax.nn.dot_product_attention` over
     contiguous K/V of the same bytes);
  3. the in-place block permutation (32 layers, 8 kv heads, D=128, bf16) at 32,
     256 and 1,024 moves, every impl that builds, against a plain copy of the
     same bytes.
Every row is checked against its reference (relative L2 error) before it is
timed. Timing: `--iters` calls back to back between two `block_until_ready`s
(the device queue stays full), `--repeats` such batches, the median per call.
All shapes are several times the 60 MB L2. Bytes of decode count whole blocks
touched (K and V); `% bw` is against the copy bandwidth of row 1.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pallas_kernels import lowering
from pallas_kernels import paged_attention as pa
from pallas_kernels import permute_blocks as pb

_OUT = flags.DEFINE_string("out", "table.md", "Markdown table, appended per row.")
_DRY = flags.DEFINE_bool("dry", False, "Lower every row for cuda (abstract H200) "
                         "instead of running it; needs no GPU.")
_DEADLINE = flags.DEFINE_float("deadline_s", 400.0,
                               "No row starts after this many seconds.")
_ITERS = flags.DEFINE_integer("iters", 20, "Calls per timed batch.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed batches (median).")
_ONLY = flags.DEFINE_list("only", [], "Run only rows whose name contains one of "
                          "these (e.g. decode,permute).")
_SMALL = flags.DEFINE_bool("small", False, "Small shapes (a quick CPU run of the "
                           "timed mode; numbers mean nothing).")

_BF16 = jnp.bfloat16
_BLOCK = 16


def _interpret():
  """Interpret mode for the Pallas impls: only in `--small` runs on a CPU."""
  return bool(_SMALL.value) and jax.default_backend() == "cpu"

_HEADS = (32, 8)
_HEAD_DIM = 128
_TOL = 2e-2  # relative L2 error allowed for bf16 rows
_MOVE_SETS = 8  # random move sets a permutation row cycles through


@dataclasses.dataclass
class Row:
  """One line of the table. `make()` builds the inputs: a list of argument
  lists (variants, cycled through when timing; the first is checked), `fn` runs
  one, `check(out, args)` returns the relative error against the reference,
  `specs` are the inputs' ShapeDtypeStructs (dry mode lowers `fn` on them).
  `chain`: each call's output replaces `args[0]` of the next (in-place moves)."""
  name: str
  impl: str
  shape: str
  fn: Callable[..., Any]
  specs: list
  make: Callable[[], list]
  check: Callable[[Any, list], float] | None
  nbytes: int
  chain: bool = False


# Timing -----------------------------------------------------------------------


def time_per_call(fn, variants, *, iters, repeats, chain=False):
  """Median seconds per call: `iters` calls between two `block_until_ready`s,
  cycling through `variants` (argument lists whose data together are several
  times the L2, so repeated calls do not time the cache). `chain`: each call's
  output replaces `args[0]` of the next (in-place moves on one pool)."""
  state = {"i": 0, "carry": None}

  def run(n):
    out = None
    for _ in range(n):
      args = variants[state["i"] % len(variants)]
      state["i"] += 1
      if chain and state["carry"] is not None:
        args = [state["carry"], *args[1:]]
      out = fn(*args)
      if chain:
        state["carry"] = out
    return jax.block_until_ready(out)

  run(len(variants))  # warm-up (compiled already by the check)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    run(iters)
    times.append((time.perf_counter() - t0) / iters)
  return statistics.median(times)


def rel_err(got, want) -> float:
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
  if not np.all(np.isfinite(got)):
    return float("nan")
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


# Rows ---------------------------------------------------------------------------


def copy_rows(nbytes):
  n = nbytes // 2
  spec = jax.ShapeDtypeStruct((n,), _BF16)
  fn = jax.jit(lambda x: x + jnp.ones((), x.dtype))
  make = lambda: [[jax.random.normal(jax.random.key(0), (n,), _BF16)]]
  check = lambda out, args: rel_err(out, args[0].astype(jnp.float32) + 1)
  return [Row("copy", "xla", f"{nbytes / 2**30:.1f} GiB", fn, [spec], make,
              check, 2 * n * 2)]


def _decode_tables(rng, batch, context):
  segs = context // _BLOCK
  num_blocks = batch * segs
  blk = rng.permutation(num_blocks).reshape(batch, segs).astype(np.int32)
  return (blk, np.zeros_like(blk), np.full_like(blk, _BLOCK),
          np.full((batch,), segs, np.int32), num_blocks)


def decode_rows(batch, context, *, heads=_HEADS, head_dim=_HEAD_DIM):
  qh, kvh = heads
  segs = context // _BLOCK
  num_blocks = batch * segs
  shape = f"b{batch} ctx{context} {qh}/{kvh} D{head_dim} bs{_BLOCK}"
  q_spec = jax.ShapeDtypeStruct((batch, qh, head_dim), _BF16)
  p_spec = jax.ShapeDtypeStruct((kvh, num_blocks, _BLOCK, head_dim), _BF16)
  t_spec = jax.ShapeDtypeStruct((batch, segs), jnp.int32)
  n_spec = jax.ShapeDtypeStruct((batch,), jnp.int32)
  specs = [q_spec, p_spec, p_spec, t_spec, t_spec, t_spec, n_spec]
  nbytes = 2 * batch * segs * kvh * _BLOCK * head_dim * 2
  cache = {}

  def make():
    if "args" not in cache:
      rng = np.random.default_rng(batch * 131 + context)
      blk, st, ln, ns, _ = _decode_tables(rng, batch, context)
      kq, kk, kv = jax.random.split(jax.random.key(batch + context), 3)
      cache["args"] = [jax.random.normal(kq, q_spec.shape, _BF16),
                       jax.random.normal(kk, p_spec.shape, _BF16),
                       jax.random.normal(kv, p_spec.shape, _BF16),
                       *(jnp.asarray(a) for a in (blk, st, ln, ns))]
    return [cache["args"]]  # pages far past the L2: one variant

  rows_checked = min(batch, 2)

  def check(out, args):
    q, k, v, *table = args
    want = pa.ref_paged_attention(q[:rows_checked].astype(jnp.float32),
                                  k, v, *[t[:rows_checked] for t in table])
    return rel_err(out[:rows_checked], want)

  rows = []
  impls = pa.lowerable_decode_impls(num_q_heads=qh, num_kv_heads=kvh,
                                    head_dim=head_dim, block_size=_BLOCK,
                                    dtype=_BF16, platform="cuda")
  impls = [i for i in impls if i != "xla"] + ["xla"]  # the costliest last
  for impl in impls:
    fn = jax.jit(lambda *a, impl=impl: pa.paged_attention(
        *a, impl=impl, num_splits=None, interpret=_interpret()))
    rows.append(Row("decode", impl, shape, fn, specs, make, check, nbytes))

  def builtin(q, k, v, blk, st, ln, ns):
    from jax.experimental.pallas.ops.gpu import paged_attention as upstream
    del st
    lengths = jnp.sum(jnp.where(jnp.arange(blk.shape[1]) < ns[:, None], ln, 0),
                      axis=1).astype(jnp.int32)
    k_splits = math.gcd(16, blk.shape[1])
    q = (q * (1 / math.sqrt(q.shape[-1]))).astype(q.dtype)  # it does not scale
    return upstream.paged_attention(q, k, v, blk, lengths, k_splits=k_splits,
                                    interpret=_interpret())

  rows.append(Row("decode", "jax-builtin", shape, jax.jit(builtin), specs, make,
                  check, nbytes))

  d_spec = jax.ShapeDtypeStruct((batch, context, kvh, head_dim), _BF16)

  def make_dense():
    kk, kv, kq = jax.random.split(jax.random.key(7 + batch + context), 3)
    return [[jax.random.normal(kq, (batch, 1, qh, head_dim), _BF16),
             jax.random.normal(kk, d_spec.shape, _BF16),
             jax.random.normal(kv, d_spec.shape, _BF16)]]

  def check_dense(out, args):
    q, k, v = (a[:rows_checked].astype(jnp.float32) for a in args)
    k = jnp.repeat(k, qh // kvh, axis=2)
    v = jnp.repeat(v, qh // kvh, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    want = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    return rel_err(out[:rows_checked], want)

  rows.append(Row("decode", "dense-xla", shape + " contiguous",
                  jax.jit(jax.nn.dot_product_attention),
                  [jax.ShapeDtypeStruct((batch, 1, qh, head_dim), _BF16),
                   d_spec, d_spec], make_dense, check_dense, nbytes))
  return rows


def permute_rows(num_moves, *, layers=32, kvh=8, head_dim=_HEAD_DIM,
                 num_blocks=None):
  num_blocks = num_blocks or max(4 * num_moves, 512)
  shape = (layers, kvh, num_blocks, _BLOCK, head_dim)
  desc = f"{num_moves} moves, pool {layers}x{kvh}x{num_blocks}x{_BLOCK}x{head_dim}"
  spec = jax.ShapeDtypeStruct(shape, _BF16)
  m_spec = jax.ShapeDtypeStruct((num_moves,), jnp.int32)
  moved = num_moves * layers * kvh * _BLOCK * head_dim
  nbytes = 2 * moved * 2

  def make():
    """One pool, `_MOVE_SETS` random move sets of disjoint src/dst: chained
    calls touch blocks all over the pool (far past the L2)."""
    rng = np.random.default_rng(num_moves)
    pages = jax.random.normal(jax.random.key(num_moves), shape, _BF16)
    variants = []
    for _ in range(_MOVE_SETS):
      perm = rng.permutation(num_blocks)
      variants.append([pages, jnp.asarray(perm[:num_moves], jnp.int32),
                       jnp.asarray(perm[num_moves:2 * num_moves], jnp.int32)])
    return variants

  def check(out, args):
    pages, src, dst = args
    return rel_err(out[:, :, dst], pages[:, :, src])

  rows = []
  impls = pb.lowerable_permute_impls(num_layers=layers, num_kv_heads=kvh,
                                     block_size=_BLOCK, head_dim=head_dim,
                                     dtype=_BF16, num_moves=num_moves,
                                     platform="cuda")
  for impl in impls:
    # Donated, so every impl updates the pool in place (without donation XLA's
    # scatter would copy the whole pool); the check runs on a copy first, then
    # timing chains calls on the output, as a compaction would.
    fn = jax.jit(lambda p, s, d, impl=impl: pb.permute_blocks(
        p, s, d, impl=impl, interpret=_interpret()), donate_argnums=(0,))
    rows.append(Row("permute", impl, desc, fn, [spec, m_spec, m_spec], make,
                    check, nbytes, chain=True))
  c_spec = jax.ShapeDtypeStruct((moved,), _BF16)
  copies = max(1, min(16, (256 << 20) // (2 * moved)))  # >= 256 MB in turn
  rows.append(Row("permute", "plain-copy", desc + f" (same bytes, {copies} bufs)",
                  jax.jit(lambda x: x + jnp.ones((), x.dtype)), [c_spec],
                  lambda: [[jax.random.normal(jax.random.key(i), (moved,), _BF16)]
                           for i in range(copies)],
                  lambda out, args: rel_err(out, args[0].astype(jnp.float32) + 1),
                  nbytes))
  return rows


def all_rows(small):
  if small:
    return (copy_rows(1 << 22) + decode_rows(2, 256, heads=(8, 2), head_dim=64)
            + permute_rows(8, layers=2, kvh=2, head_dim=64, num_blocks=64))
  # Cheapest first (bytes moved): 64 MB, 0.5 GB, 0.5 GB, 2 GB, 2 GB.
  return (copy_rows(2 << 30) + permute_rows(32) + decode_rows(1, 131072)
          + permute_rows(256) + decode_rows(64, 8192) + permute_rows(1024))


# Table --------------------------------------------------------------------------

_HEADER = ("| row | impl | shape | status | us/call | GB/s | % copy bw | rel err |\n"
           "|---|---|---|---|---|---|---|---|\n")


def append(path, line):
  with open(path, "a") as f:
    f.write(line + "\n")
    f.flush()
    os.fsync(f.fileno())
  print(line, flush=True)


def run_row(row, *, dry, iters, repeats, copy_bw):
  """Returns (status, seconds per call or None, rel err or None)."""
  if dry:
    lowering.lower_for_gpu(row.fn, *row.specs)
    return "lowered (cuda, abstract H200)", None, None
  variants = row.make()
  first = variants[0]
  if row.chain:  # the check must not donate the pool the timing starts from
    first = [jnp.copy(first[0]), *first[1:]]
  out = jax.block_until_ready(row.fn(*first))
  err = row.check(out, variants[0]) if row.check else None
  del out
  if err is not None and not err <= _TOL:
    return f"WRONG (rel err {err:.3g})", None, err
  t = time_per_call(row.fn, variants, iters=iters, repeats=repeats,
                    chain=row.chain)
  return "ok", t, err


def main(argv):
  del argv
  t_start = time.monotonic()
  path = _OUT.value
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  dev = jax.devices()[0]
  with open(path, "a") as f:
    f.write(f"\n{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} jax "
            f"{jax.__version__} device {dev.device_kind} ({dev.platform}); "
            f"{' '.join(sys.argv)}\n\n" + _HEADER)
  print(_HEADER, end="", flush=True)
  copy_bw = None
  failures = 0
  for row in all_rows(_SMALL.value):
    if _ONLY.value and not any(o in row.name for o in _ONLY.value) and (
        row.name != "copy"):
      continue
    label = f"| {row.name} | {row.impl} | {row.shape} |"
    left = _DEADLINE.value - (time.monotonic() - t_start)
    if left <= 0:
      append(path, f"{label} skipped (global deadline) | | | | |")
      continue
    try:
      status, t, err = run_row(row, dry=_DRY.value, iters=_ITERS.value,
                               repeats=_REPEATS.value, copy_bw=copy_bw)
    except Exception as e:  # a failure is a row, never the end of the table
      failures += 1
      msg = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
      append(path, f"{label} FAILED {msg[:300]} | | | | |")
      traceback.print_exc()
      continue
    if status != "ok" and not status.startswith("lowered"):
      failures += 1
    if t is None:
      append(path, f"{label} {status} | | | | {'' if err is None else f'{err:.2e}'} |")
      continue
    rate = row.nbytes / t
    if row.name == "copy" and copy_bw is None:
      copy_bw = rate
    frac = f"{100 * rate / copy_bw:.1f}" if copy_bw else ""
    append(path, f"{label} {status} | {t * 1e6:.1f} | {rate / 1e9:.1f} | {frac} | "
           f"{'' if err is None else f'{err:.2e}'} |")
  append(path, f"\n{failures} rows failed; {time.monotonic() - t_start:.0f} s")
  return 1 if failures else 0


if __name__ == "__main__":
  app.run(main)

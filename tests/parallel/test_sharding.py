"""Tensor-parallel pool (paged_kv.parallel.sharding) on an 8-device CPU mesh.

The forced device count (`XLA_FLAGS=--xla_force_host_platform_device_count=8`)
only takes effect before JAX initialises its backend, and the rest of the suite
runs in this process with one device. So the checks run in one subprocess
(this file executed with `--sharding-worker`), which reports a JSON dict of
`{check name: "ok" | traceback}` on its last stdout line; each check is then
one test here. Validation errors that need no mesh larger than one device run
in process.

Run the worker alone: `XLA_FLAGS=--xla_force_host_platform_device_count=8
python tests/test_sharding.py --sharding-worker`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
import pytest

import paged_kv
from paged_kv.core import compact
from paged_kv.parallel import sharding
from paged_kv.core.config import PoolConfig

pytestmark = pytest.mark.slow

NUM_DEVICES = 8
WORKER_FLAG = "--sharding-worker"
WORKER_TIMEOUT_S = 240
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Eight kv heads, one per device; 16 query heads (GQA group of 2).
CONFIG = PoolConfig(num_blocks=48, block_size=8, num_layers=2, num_kv_heads=8, head_dim=16,
                    dtype="float32", max_seqs=8, max_segments=12)
NUM_Q_HEADS = 16
MAX_NEW = 24
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                "collective-permute")


# ---------------------------------------------------------------------------
# The scenario, run once on one device and once on the mesh.


def _i32(x) -> jax.Array:
  return jnp.asarray(x, jnp.int32)


def _normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
  """Fresh f32 normals from numpy (jax.random's sampler costs seconds to compile on CPU)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def _copy(tree):
  """A copy of every array of `tree`, same sharding (the transitions donate their input)."""
  return jax.tree.map(lambda x: x.copy(), tree)


def _scenario(state: paged_kv.PoolState, mesh: jax.sharding.Mesh | None) -> dict:
  """Open, reserve, write, fork, release, attention, gather, compaction.

  Same inputs either way; `mesh=None` uses the one-device functions, else the
  `sharding.sharded_*` ones for K/V traffic. Returns every intermediate
  output (as numpy) and the final state, plus the states of the compaction.
  """
  cfg = CONFIG
  out: dict = {}

  def write(state, slot_idx, step):
    for layer in range(cfg.num_layers):
      shape = slot_idx.shape + (cfg.num_kv_heads, cfg.head_dim)
      k = _normal(20 * step + 2 * layer, shape)
      v = _normal(20 * step + 2 * layer + 1, shape)
      if mesh is None:
        pages = paged_kv.jit_write_kv(state.pages, _i32(layer), slot_idx, k, v)
      else:
        pages = sharding.sharded_write_kv(state.pages, layer, slot_idx, k, v, mesh=mesh)
      state = paged_kv.PoolState(pages=pages, meta=state.meta, table=state.table,
                                 step=state.step)
    return state

  def reserve(state, seq_ids, num_new, step):
    state, (slot_idx, status) = paged_kv.reserve_tokens(
        state, _i32(seq_ids), _i32(num_new), config=cfg, max_new_tokens=MAX_NEW)
    out[f"reserve{step}"] = (np.asarray(slot_idx), np.asarray(status))
    out[f"meta_after_reserve{step}"] = _copy(state.meta)
    return write(state, slot_idx, step)

  b = 5
  state, status = paged_kv.open_sequence(
      state, _i32([0, 1, 2, 3, 5]), jnp.zeros((b, 1), jnp.int32), jnp.zeros((b, 1), jnp.int32),
      jnp.ones((b, 1), jnp.int32), jnp.zeros((b,), jnp.int32), config=cfg)
  out["open"] = np.asarray(status)
  state = reserve(state, [0, 1, 2, 3, 5], [13, 5, 20, 9, 17], 0)
  state, status = paged_kv.fork(state, _i32([1]), _i32([4]), config=cfg)
  out["fork"] = np.asarray(status)
  state = reserve(state, [4, 1, 0, 3, -1], [7, 3, 24, 2, 0], 1)
  state, status = paged_kv.release(state, _i32([2, 3]), config=cfg)  # holes below live blocks
  out["release"] = np.asarray(status)
  state = reserve(state, [5, 0, -1, -1, -1], [1, 4, 0, 0, 0], 2)
  out["state"] = _copy(state)

  rows = _i32([0, 1, 4, 5])
  t = state.table
  q = _normal(1000, (rows.shape[0], NUM_Q_HEADS, cfg.head_dim))
  table_args = (t.block[rows], t.start[rows], t.length[rows], t.num_segments[rows])
  out["attn_inputs"] = (q, table_args)
  for layer in range(cfg.num_layers):
    kp, vp = state.pages.k[layer], state.pages.v[layer]
    if mesh is None:
      from pallas_kernels import decode_attention as pa
      o = pa.decode_attention(q, kp, vp, *table_args, impl="xla")
    else:
      o = sharding.sharded_paged_attention(q, kp, vp, *table_args, mesh=mesh, impl="xla")
      out[f"attn_sharding{layer}"] = o.sharding
    out[f"attn{layer}"] = np.asarray(o)
  for seq in (0, 1, 4, 5):
    k, v, valid = paged_kv.gather_kv(state, seq, max_len=64)
    out[f"gather{seq}"] = tuple(np.asarray(x) for x in (k, v, valid))

  src, dst = compact.plan_compaction(state.meta, budget=8)
  out["plan"] = _copy((src, dst))
  state, (remap, status) = compact.compact_permute(state, src, dst, config=cfg)
  out["remap"], out["compact_status"] = remap, np.asarray(status)
  out["compacted"] = state
  return out


# ---------------------------------------------------------------------------
# Worker-side checks. Each takes the shared context and raises on failure.


def _leaves_equal(a, b, what: str) -> None:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb), what
  for i, (x, y) in enumerate(zip(la, lb)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, (
        f"{what}[{i}]: {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
    assert np.array_equal(x, y, equal_nan=True), f"{what}[{i}] differs"


def _shards_identical(a: jax.Array, what: str) -> None:
  shards = [np.asarray(s.data) for s in a.addressable_shards]
  assert len(shards) == NUM_DEVICES, f"{what}: {len(shards)} shards"
  for i, s in enumerate(shards[1:], 1):
    assert np.array_equal(s, shards[0]), f"{what}: shard {i} differs from shard 0"


def _assert_pool_sharded(state: paged_kv.PoolState, mesh, what: str) -> None:
  pages = jax.sharding.NamedSharding(mesh, sharding.page_spec())
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  for name, a in (("k", state.pages.k), ("v", state.pages.v)):
    assert a.sharding.is_equivalent_to(pages, a.ndim), f"{what}: pages.{name} {a.sharding}"
  for i, a in enumerate(jax.tree.leaves((state.meta, state.table, state.step))):
    assert a.sharding.is_equivalent_to(rep, a.ndim), f"{what}: metadata leaf {i} {a.sharding}"


def check_bit_identical(ctx) -> None:
  """Every output and the final state equal one device bit for bit (jnp path)."""
  one, tp = ctx["one"], ctx["tp"]
  for name in sorted(one):
    if name.startswith("attn"):
      continue  # check_attention
    _leaves_equal(one[name], tp[name], name)
  for name in ("reserve0", "reserve1", "reserve2"):
    assert (one[name][1] == 0).all(), f"{name} failed: {one[name][1]}"
  assert (one["reserve1"][0] >= 0).sum() == 36 and (one["reserve2"][0] >= 0).sum() == 5


def check_attention(ctx) -> None:
  """Sharded attention = one device on the same head group, bit for bit.

  Against one device computing all 8 heads at once the outputs differ by at
  most an ulp or two: XLA:CPU's vectorised `exp` rounds some elements
  differently depending on the array's shape (8 heads vs 1 per call), not on
  the sharding. The per-group comparison pins the sharded path to the
  one-device kernel exactly; the tolerance check bounds the rest.
  """
  from pallas_kernels import decode_attention as pa
  one, tp = ctx["one"], ctx["tp"]
  state = one["state"]
  group = NUM_Q_HEADS // CONFIG.num_kv_heads
  q, table_args = one["attn_inputs"]
  for layer in range(CONFIG.num_layers):
    got, whole = tp[f"attn{layer}"], one[f"attn{layer}"]
    assert np.isfinite(whole).all() and np.abs(whole).sum() > 0
    for h in range(CONFIG.num_kv_heads):
      want = pa.decode_attention(q[:, h * group:(h + 1) * group], state.pages.k[layer, h:h + 1],
                                state.pages.v[layer, h:h + 1], *table_args, impl="xla")
      np.testing.assert_array_equal(got[:, h * group:(h + 1) * group], np.asarray(want),
                                    err_msg=f"layer {layer} kv head {h}")
    np.testing.assert_allclose(got, whole, rtol=1e-6, atol=1e-6)


def check_layout_kept(ctx) -> None:
  """Pages stay split over heads, metadata replicated, through every transition."""
  mesh = ctx["mesh"]
  _assert_pool_sharded(ctx["tp"]["state"], mesh, "after reserve/write/release")
  _assert_pool_sharded(ctx["tp"]["compacted"], mesh, "after compact_permute")
  fresh = sharding.init_sharded_pool(CONFIG, mesh)
  _assert_pool_sharded(fresh, mesh, "init_sharded_pool")
  _leaves_equal(fresh, paged_kv.init_pool(CONFIG), "init_sharded_pool")
  q_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tp", None))
  assert ctx["tp"]["attn_sharding0"].is_equivalent_to(q_sharding, 3), ctx["tp"]["attn_sharding0"]


def check_bytes_per_device(ctx) -> None:
  """Each device holds 1/8 of the page bytes: one kv head of every block."""
  state = ctx["tp"]["state"]
  total = state.pages.k.nbytes + state.pages.v.nbytes
  per_device = sharding.bytes_per_device(state)
  assert len(per_device) == NUM_DEVICES, per_device
  assert set(per_device.values()) == {total // NUM_DEVICES}, (per_device, total)
  for shard in state.pages.k.addressable_shards:
    assert shard.data.shape == (CONFIG.num_layers, 1, CONFIG.num_blocks, CONFIG.block_size,
                                CONFIG.head_dim), shard.data.shape


def check_metadata_identical_on_shards(ctx) -> None:
  """Allocation decisions (metadata, tables, slots) are the same array on every device."""
  tp = ctx["tp"]
  for name in ("meta_after_reserve0", "meta_after_reserve1", "meta_after_reserve2"):
    for i, leaf in enumerate(jax.tree.leaves(tp[name])):
      _shards_identical(leaf, f"{name}[{i}]")
  for i, leaf in enumerate(jax.tree.leaves((tp["state"].table, tp["compacted"].meta,
                                            tp["compacted"].table))):
    _shards_identical(leaf, f"table/meta leaf {i}")


def check_compaction_same_blocks(ctx) -> None:
  """compact_permute moves the same blocks on every shard; each shard = its heads of one device."""
  one, tp = ctx["one"], ctx["tp"]
  src, dst = (np.asarray(x) for x in one["plan"])
  assert (src >= 0).sum() >= 2, f"scenario should leave blocks to move, plan {src} -> {dst}"
  assert (one["compact_status"] == 0).all(), one["compact_status"]
  for a in (*tp["plan"], tp["remap"]):
    _shards_identical(a, "plan/remap")
  want = np.asarray(one["compacted"].pages.k)
  moved_src, moved_dst = src[src >= 0], dst[src >= 0]
  before = np.asarray(one["state"].pages.k)
  np.testing.assert_array_equal(want[:, :, moved_dst], before[:, :, moved_src])
  for shard in tp["compacted"].pages.k.addressable_shards:
    heads = shard.index[1]
    np.testing.assert_array_equal(np.asarray(shard.data), want[:, heads])


def check_no_collectives(ctx) -> None:
  """The compiled transitions on the sharded pool communicate nothing."""
  mesh, cfg = ctx["mesh"], CONFIG
  state = sharding.shard_pool(paged_kv.init_pool(cfg), mesh)
  seq = _i32([0, 1])
  hlo = {
      "reserve_tokens": paged_kv.reserve_tokens.lower(
          state, seq, _i32([3, 4]), config=cfg, max_new_tokens=MAX_NEW),
      "compact_permute": compact.compact_permute.lower(state, _i32([5]), _i32([1]), config=cfg),
      "sharded_write_kv": sharding.sharded_write_kv.lower(
          state.pages, 0, _i32([[1, 2]]), jnp.zeros((1, 2, 8, 16)), jnp.zeros((1, 2, 8, 16)),
          mesh=mesh),
      "sharded_paged_attention": sharding.sharded_paged_attention.lower(
          jnp.zeros((2, NUM_Q_HEADS, 16)), state.pages.k[0], state.pages.v[0],
          state.table.block[:2], state.table.start[:2], state.table.length[:2],
          state.table.num_segments[:2], mesh=mesh),
  }
  for name, lowered in hlo.items():
    text = lowered.compile().as_text()
    found = [c for c in _COLLECTIVES if c in text]
    assert not found, f"{name} compiles to collectives {found}"


def check_sharded_move_pages(ctx) -> None:
  """The shard_map block move (for the kernel paths) equals compact_permute's page copy."""
  one, mesh = ctx["one"], ctx["mesh"]
  src, dst = one["plan"]
  pages = sharding.shard_pool(one["state"], mesh).pages
  moved = sharding.sharded_move_pages(pages, src, dst, mesh=mesh, impl="xla")
  _leaves_equal(moved, one["compacted"].pages, "sharded_move_pages")
  assert moved.k.sharding.is_equivalent_to(
      jax.sharding.NamedSharding(mesh, sharding.page_spec()), 5)


def check_clear_errors(ctx) -> None:
  """Heads that do not divide over the axis, or GQA groups that cannot split, raise."""
  mesh = ctx["mesh"]
  bad = PoolConfig(num_blocks=8, block_size=8, num_kv_heads=12, head_dim=16, max_seqs=2,
                   max_segments=2)
  for fn in (lambda: sharding.shard_pool(paged_kv.init_pool(bad), mesh),
             lambda: sharding.sharded_write_kv(
                 paged_kv.init_pool(bad).pages, 0, _i32([0]), jnp.zeros((1, 12, 16)),
                 jnp.zeros((1, 12, 16)), mesh=mesh)):
    try:
      fn()
    except ValueError as e:
      assert "not divisible by the size 8" in str(e), str(e)
    else:
      raise AssertionError("num_kv_heads=12 on 8 devices did not raise")
  state = sharding.shard_pool(paged_kv.init_pool(CONFIG), mesh)
  t = state.table
  try:
    sharding.sharded_paged_attention(jnp.zeros((2, 12, 16)), state.pages.k[0], state.pages.v[0],
                                     t.block[:2], t.start[:2], t.length[:2],
                                     t.num_segments[:2], mesh=mesh)
  except ValueError as e:
    assert "not a multiple of num_kv_heads=8" in str(e), str(e)
  else:
    raise AssertionError("12 query heads over 8 kv heads did not raise")


def check_explicit_mesh(ctx) -> None:
  """A mesh with Explicit axes (`jax.make_mesh`'s default) works too: inputs are resharded."""
  one = ctx["one"]
  mesh = jax.make_mesh((NUM_DEVICES,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,))
  pages = sharding.shard_pool(one["state"], mesh).pages
  slot_idx = jnp.asarray(one["reserve2"][0])
  k = _normal(7, slot_idx.shape + (CONFIG.num_kv_heads, CONFIG.head_dim))
  pages = sharding.sharded_write_kv(pages, 1, slot_idx, k, -k, mesh=mesh)
  want = paged_kv.jit_write_kv(_copy(one["state"].pages), _i32(1), slot_idx, k, -k)
  _leaves_equal(pages, want, "explicit-mesh write_kv")
  q, table_args = one["attn_inputs"]
  got = sharding.sharded_paged_attention(q, pages.k[1], pages.v[1], *table_args, mesh=mesh)
  auto = sharding.shard_pool(dataclasses.replace(one["state"], pages=want), ctx["mesh"]).pages
  ref = sharding.sharded_paged_attention(q, auto.k[1], auto.v[1], *table_args, mesh=ctx["mesh"])
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def check_staged_resize(ctx) -> None:
  """A staged resize (through host memory, one layer at a time) keeps the pages split
  over heads and equals the one-device device-path resize bit for bit."""
  from paged_kv.core import regions, resize# pylint: disable=g-import-not-at-top
  one, tp, mesh = ctx["one"], ctx["tp"], ctx["mesh"]
  held = np.flatnonzero(np.asarray(one["compacted"].meta.ref_count))
  cut = max(int(held.max()) + 1, CONFIG.num_base_blocks + 1)
  for n in (cut, CONFIG.num_blocks + 8):
    new = regions.resized_config(CONFIG, n)
    want = regions.resize_state(one["compacted"], config=CONFIG, new_config=new)
    got, report = resize.resize_state_staged(_copy(tp["compacted"]), config=CONFIG,
                                             new_config=new)
    assert report.staged and report.new_blocks == n, report
    _assert_pool_sharded(got, mesh, f"staged resize to {n}")
    _leaves_equal(want, got, f"staged resize to {n}")


CHECKS: dict[str, Callable[[dict], None]] = {
    f.__name__.removeprefix("check_"): f for f in (
        check_bit_identical, check_attention, check_layout_kept, check_bytes_per_device,
        check_metadata_identical_on_shards, check_compaction_same_blocks,
        check_no_collectives, check_sharded_move_pages, check_explicit_mesh,
        check_clear_errors, check_staged_resize)
}


def _worker_main() -> None:
  """Runs the scenario on one device and on the 8-device mesh, then every check."""
  results: dict[str, str] = {}
  try:
    assert jax.device_count() == NUM_DEVICES, (
        f"worker sees {jax.device_count()} devices; XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
    mesh = sharding.make_tp_mesh(NUM_DEVICES)
    t0 = time.perf_counter()
    one = _scenario(paged_kv.init_pool(CONFIG), None)
    t1 = time.perf_counter()
    tp = _scenario(sharding.shard_pool(paged_kv.init_pool(CONFIG), mesh), mesh)
    print(f"scenario: one device {t1 - t0:.1f}s, mesh {time.perf_counter() - t1:.1f}s",
          file=sys.stderr)
    ctx = {"mesh": mesh, "one": one, "tp": tp}
  except Exception:  # pylint: disable=broad-except
    results = {name: "setup failed:\n" + traceback.format_exc() for name in CHECKS}
  else:
    for name, check in CHECKS.items():
      try:
        t0 = time.perf_counter()
        check(ctx)
        print(f"{name}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        results[name] = "ok"
      except Exception:  # pylint: disable=broad-except
        results[name] = traceback.format_exc()
  print(json.dumps(results))


# ---------------------------------------------------------------------------
# The tests (parent process, one device).


def _run_worker() -> dict[str, str]:
  env = dict(os.environ)
  flags = env.get("XLA_FLAGS", "")
  # First: XLA stops honouring flags after a token it cannot parse (conftest's
  # "intra_op_parallelism_threads=1" is one), so a flag appended last is lost.
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={NUM_DEVICES} {flags}".strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), WORKER_FLAG], env=env,
                        cwd=_ROOT, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S,
                        check=False)
  lines = proc.stdout.strip().splitlines()
  if proc.returncode != 0 or not lines:
    raise RuntimeError(f"sharding worker failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
  return json.loads(lines[-1])


class ShardedPoolTest(parameterized.TestCase):
  """One subprocess with 8 CPU devices; each check reported as its own test."""

  _results: dict[str, str] | None = None

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._results = _run_worker()

  @parameterized.named_parameters((name, name) for name in CHECKS)
  def test_check(self, name):
    self.assertEqual(self._results.get(name), "ok", msg=f"\n{self._results.get(name)}")


class ValidationTest(absltest.TestCase):
  """Errors that need no more than the in-process device."""

  def test_missing_axis(self):
    mesh = sharding.make_tp_mesh(1, axis="model")
    with self.assertRaisesRegex(ValueError, r"no axis 'tp'.*\('model',\)"):
      sharding.shard_pool(paged_kv.init_pool(CONFIG), mesh)

  def test_not_a_mesh(self):
    with self.assertRaisesRegex(TypeError, "jax.sharding.Mesh"):
      sharding.validate_heads(8, "tp", "tp")

  def test_too_many_devices(self):
    with self.assertRaisesRegex(ValueError, "num_devices must be in"):
      sharding.make_tp_mesh(jax.device_count() + 1)

  def test_one_device_mesh_is_identity(self):
    state = paged_kv.init_pool(CONFIG)
    placed = sharding.shard_pool(state, sharding.make_tp_mesh(1))
    _leaves_equal(state, placed, "one-device shard_pool")


if __name__ == "__main__":
  if WORKER_FLAG in sys.argv:
    _worker_main()
  else:
    absltest.main()

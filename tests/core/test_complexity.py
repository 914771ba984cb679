"""Guards that every host-API transition is O(batch): nothing touches the whole pool.

Timing-free and structural, at a 1M-block pool that is never allocated (the
functions are traced and compiled from abstract shapes):

- the traced program (jaxpr) has no equation producing an array of
  `num_blocks / 32` elements or more (a per-block array, or the free bitmap),
  except in-place updates (scatter, dynamic_update_slice) of the state's own
  arrays: so no free-list rebuild, no whole-array select for atomicity, no
  `zeros(num_blocks)` scratch;
- the compiled program (HLO, after XLA's fusion and copy insertion) has no
  instruction of that size other than parameters, in-place scatters and
  bookkeeping (tuples, bitcasts): XLA did not insert a copy of a donated
  per-block array (which it does when a gather of it is scheduled after an
  in-place update).

Either check fails when a transition gains an O(num_blocks) pass.
"""

from __future__ import annotations

import dataclasses
import re

from absl.testing import absltest, parameterized
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

import paged_kv
from paged_kv.pool import kv_io
from paged_kv.core import alloc, commit, sequences
from paged_kv.pool.changes import CommitWidths, empty_batch
from paged_kv.pool.host_state import HostState

N = 1 << 20
CONFIG = paged_kv.PoolConfig(num_blocks=N, block_size=16, num_layers=1, num_kv_heads=1,
                             head_dim=1, dtype="bfloat16", max_seqs=64, max_segments=32)
BIG = N // 32  # the free bitmap's words: anything this large is per-block work

# Primitives that update an operand in place (with the state donated), or views.
_IN_PLACE = {"reshape", "squeeze", "expand_dims", "scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter-min", "scatter-max",
             "dynamic_update_slice", "optimization_barrier"}
_CALLS = {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
          "remat", "checkpoint",
          # A loop's carried arrays are its body's outputs (checked there) and stay in
          # place; the compiled-HLO check catches a copy XLA would insert around it.
          "while"}


def _i32(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.int32)


def _abstract_state():
  return jax.eval_shape(lambda: paged_kv.init_pool(CONFIG))


def _size(aval) -> int:
  return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def _big_equations(jaxpr) -> list[str]:
  """Equations (recursively) that produce a large array and do not update in place."""
  found = []
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    subs = [v for v in eqn.params.values() if isinstance(v, (jax.extend.core.ClosedJaxpr,
                                                             jax.extend.core.Jaxpr))]
    subs += [j for v in eqn.params.values() if isinstance(v, (tuple, list))
             for j in v if isinstance(j, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr))]
    if subs:
      for sub in subs:
        found += _big_equations(getattr(sub, "jaxpr", sub))
      if name in _CALLS:
        continue
    if name in _IN_PLACE:
      continue
    for out in eqn.outvars:
      if _size(out.aval) >= BIG:
        found.append(f"{name} -> {out.aval.str_short()}")
  return found


_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def _hlo_big_instructions(hlo: str) -> list[str]:
  """Entry instructions of the compiled HLO that produce a large array and are not
  parameters, in-place scatters (or fusions rooted in one) or bookkeeping."""
  comps, current, roots = {}, None, {}
  for line in hlo.splitlines():
    m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if m and "=" not in line.split("(")[0]:
      current = m.group(2)
      comps[current] = []
      if m.group(1):
        comps["__entry__"] = comps[current]
      continue
    if current is not None:
      comps[current].append(line)
      if line.strip().startswith("ROOT"):
        op = re.search(r"=\s*[^=]*?\s([a-z\-]+)\(", line)
        roots[current] = op.group(1) if op else ""
  bad = []
  for line in comps.get("__entry__", []):
    m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.+?) ([a-z\-]+)\(", line)
    if not m:
      continue
    shape_text, op = m.groups()
    if op in ("parameter", "tuple", "get-tuple-element", "bitcast", "scatter",
              "dynamic-update-slice", "opt-barrier",
              "while", "call"):  # a loop (or its wrapper) passing its carried buffers on
      continue
    sizes = [int(np.prod([int(d) for d in s.split(",") if d], dtype=np.int64))
             for s in _SHAPE.findall(shape_text)]
    if not sizes or max(sizes) < BIG:
      continue
    if op == "fusion":
      called = re.search(r"calls=%([\w.\-]+)", line)
      if called and roots.get(called.group(1)) in ("scatter", "dynamic-update-slice"):
        continue
    bad.append(line.strip()[:160])
  return bad


def _host_api_calls():
  """`(name, jitted function, args, static kwargs)`: what `BlockPool` calls."""
  c = CONFIG
  calls = [
      ("open_sequence", sequences.open_sequence, (_i32(1), _i32(1, 0), _i32(1, 0), _i32(1, 0),
                                                 _i32(1)), dict(config=c, atomic=True)),
      ("open_sequence_one", sequences.open_sequence, (_i32(1), _i32(1, 1), _i32(1, 1),
                                                     _i32(1, 1), _i32(1)),
       dict(config=c, atomic=True)),  # what BlockPool passes for 0 or 1 segments
      ("open_sequence_prefix", sequences.open_sequence,
       (_i32(1), _i32(1, 4), _i32(1, 4), _i32(1, 4), _i32(1)), dict(config=c, atomic=True)),
      ("release", sequences.release, (_i32(4),), dict(config=c, atomic=True)),
      ("fork", sequences.fork, (_i32(1), _i32(1)), dict(config=c, atomic=True)),
      ("release_one", sequences.release, (_i32(1),), dict(config=c, atomic=True)),
      ("apply_ref_deltas_one", alloc.apply_ref_deltas, (_i32(1), _i32(1)), dict(config=c)),
      ("apply_ref_deltas", alloc.apply_ref_deltas, (_i32(4), _i32(4)), dict(config=c)),
      ("apply_ref_deltas_1k", alloc.apply_ref_deltas, (_i32(1024), _i32(1024)),
       dict(config=c)),
      ("allocate_never", alloc.allocate, (_i32(),),
       dict(config=c, max_blocks=4, contiguous="never")),
      ("allocate_one", alloc.allocate, (_i32(),),
       dict(config=c, max_blocks=1, contiguous="prefer")),
  ]
  for b in (1, 32, 256):
    for t in (1, 16):
      calls.append((f"reserve_b{b}_t{t}", sequences.reserve_tokens, (_i32(b), _i32(b)),
                    dict(config=c, max_new_tokens=t, atomic=True)))
  # The pool's commit (what every flush runs) at its widths: with copies, with moves.
  host = HostState.empty(c)
  for w in CommitWidths.all_for(c):
    if (w.moves and w.copies) or w.moves > 512:  # (the larger move buckets: same code)
      continue
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                         empty_batch(host, w))
    calls.append((f"commit_r{w.rows}_c{w.copies}_m{w.moves}", commit.commit, (batch,),
                  dict(config=c)))
    if w.copies:  # scrubbing zeroes freed blocks around the copies: in place too
      calls.append((f"commit_scrub_r{w.rows}_c{w.copies}", commit.commit, (batch,),
                    dict(config=dataclasses.replace(c, scrub_freed_blocks=True))))
  return calls


class ComplexityTest(parameterized.TestCase):

  @parameterized.named_parameters(*[(name, fn, args, kw)
                                    for name, fn, args, kw in _host_api_calls()])
  def test_no_pool_sized_work(self, fn, args, kwargs):
    state = _abstract_state()
    jaxpr = jax.make_jaxpr(lambda s, *a: fn(s, *a, **kwargs))(state, *args)
    self.assertEqual(_big_equations(jaxpr.jaxpr), [],
                     "equations producing a num_blocks-sized array (O(num_blocks) work)")
    compiled = fn.lower(state, *args, **kwargs).compile()
    self.assertEqual(_hlo_big_instructions(compiled.as_text()), [],
                     "compiled instructions producing a num_blocks-sized array")

  @parameterized.named_parameters(("prefer", "prefer"), ("require", "require"))
  def test_contiguous_allocate_compiled_in_place(self, contiguous):
    """A contiguous allocate searches the bitmap only in a branch taken when the lowest
    free blocks are not a run; its entry computation copies nothing pool-sized."""
    state = _abstract_state()
    compiled = alloc.allocate.lower(state, _i32(), config=CONFIG, max_blocks=4,
                                    contiguous=contiguous).compile()
    self.assertEqual(_hlo_big_instructions(compiled.as_text()), [])

  def test_write_kv_and_segments_row(self):
    state = _abstract_state()
    compiled = kv_io.write_state.lower(
        state, jnp.int32(0), _i32(32, 1),
        jax.ShapeDtypeStruct((32, 1, 1, 1), jnp.bfloat16),
        jax.ShapeDtypeStruct((32, 1, 1, 1), jnp.bfloat16)).compile()
    self.assertEqual(_hlo_big_instructions(compiled.as_text()), [])

  def test_layered_write_in_place(self):
    state = _abstract_state()
    compiled = kv_io.write_layers.lower(
        state, _i32(64), jax.ShapeDtypeStruct((1, 1, 64, 1), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, 1, 64, 1), jnp.bfloat16)).compile()
    self.assertEqual(_hlo_big_instructions(compiled.as_text()), [])

  def test_the_checks_can_fail(self):
    """A free-list rebuild and a whole-array select are caught by both checks."""
    state = _abstract_state()

    @jax.jit
    def rebuild(state, ok):
      meta = state.meta
      bits, counts, num = alloc.rebuild_free_index(meta.ref_count, meta.region)
      return jnp.where(ok, bits, meta.free_bits), counts, num

    jaxpr = jax.make_jaxpr(rebuild)(state, jax.ShapeDtypeStruct((), bool))
    self.assertNotEqual(_big_equations(jaxpr.jaxpr), [])
    compiled = rebuild.lower(state, jax.ShapeDtypeStruct((), bool)).compile()
    self.assertNotEqual(_hlo_big_instructions(compiled.as_text()), [])


if __name__ == "__main__":
  absltest.main()

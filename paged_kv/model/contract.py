"""The model contract: what `ModelExecutor` and the jitted steps call, checked once.

    pages, logits = model(tokens, pages, meta, impl=impl, interpret=interpret)
    pages, logits = model(..., logits_indices=idx)   # if the model names the keyword

`tokens: i32[T]` ragged; every layer writes and reads through `paged_attention`
and passes the pages on; logits are `[T, vocab]`, or `[R, vocab]` for the
`logits_indices` form. The table: `docs/model.md`.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from paged_kv.core.config import PoolConfig
from paged_kv.core.errors import InvalidArgument
from paged_kv.core.state import KVPages
from paged_kv.model.metadata import StepMetadata

__all__ = ["LOGITS_INDICES", "ModelContractError", "PagedModel", "accepts_logits_indices",
           "check_model"]

LOGITS_INDICES = "logits_indices"  # the optional keyword (vLLM's name)


class ModelContractError(InvalidArgument):
  """A model does not meet the contract of `paged_kv.model.contract`."""


@runtime_checkable
class PagedModel(Protocol):
  """A model `ModelExecutor` can serve (see the module docstring)."""

  def __call__(self, tokens: jax.Array, pages: KVPages, meta: StepMetadata, *,
               impl: str | None = None, interpret: Any = None) -> tuple[KVPages, jax.Array]:
    ...


def accepts_logits_indices(model: Any) -> bool:
  """Whether `logits_indices` is a keyword parameter of `model`'s own signature.

  `**kwargs` does not count and an unreadable signature counts as no. Static per
  class, so the steps decide it while tracing.
  """
  try:
    params = inspect.signature(model).parameters
  except (TypeError, ValueError):
    return False
  p = params.get(LOGITS_INDICES)
  return p is not None and p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                      inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _check_signature(model: Any) -> None:
  if not callable(model):
    raise ModelContractError(f"the model must be callable as model(tokens, pages, meta, *, "
                             f"impl, interpret); got a {type(model).__name__}")
  try:
    sig = inspect.signature(model)
  except (TypeError, ValueError):
    return  # not introspectable (a builtin, a C extension): the abstract step decides
  try:
    sig.bind(0, 0, 0, impl=None, interpret=None)
  except TypeError as err:
    raise ModelContractError(
        f"{type(model).__name__}.__call__{sig} must accept (tokens, pages, meta) and the "
        f"keywords impl= and interpret= (forward them to paged_attention): {err}") from None


# The abstract steps `check_model` traces: (name, rows B, tokens T, max_query_len).
# Tokens outnumber rows in the last two, so logits of one row per token ([T, vocab])
# and of one row per sequence ([B, vocab]) differ in shape there.
ABSTRACT_STEPS = (("decode", 4, 4, 1), ("prefill", 1, 16, 16), ("mixed", 4, 16, 13))

_MARK_NAME = "_paged_kv_layer_mark"


def _paged_kv_layer_mark(layer):
  return layer


_mark = jax.jit(_paged_kv_layer_mark)


def _abstract_step(config: PoolConfig, num_rows: int, num_tokens: int,
                   max_query_len: int) -> tuple:
  """Abstract `(tokens, pages, meta)` of a step of `num_rows` rows and `num_tokens` tokens."""
  shape = (config.num_layers, config.num_kv_heads, config.num_blocks, config.block_size,
           config.head_dim)
  page = jax.ShapeDtypeStruct(shape, config.jnp_dtype)
  pages = KVPages(k=page, v=page)
  b, t, s = num_rows, num_tokens, config.max_segments
  i32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32)
  meta = StepMetadata(seq_ids=i32(b), positions=i32(t), slot_mapping=i32(t),
                      cu_q_lens=i32(b + 1), seg_block=i32(b, s), seg_start=i32(b, s),
                      seg_length=i32(b, s), num_segments=i32(b), seq_lens=i32(b),
                      num_decodes=i32(), num_prefills=i32(), max_query_len=max_query_len)
  return i32(t), pages, meta


def _subjaxprs(eqn) -> list:
  """The jaxprs nested in `eqn`'s parameters (scan, while, cond, jit, custom rules)."""
  found = []
  for value in eqn.params.values():
    for v in (value if isinstance(value, (tuple, list)) else (value,)):
      inner = getattr(v, "jaxpr", v)
      if hasattr(inner, "eqns"):
        found.append(inner)
  return found


def _layer_marks(jaxpr, times: int | None = 1) -> list[tuple[int | None, int | None]]:
  """`(times per step, layer)` of each `paged_attention` marker in `jaxpr` (None: unknown)."""
  marks = []
  for eqn in jaxpr.eqns:
    if eqn.params.get("name") == _MARK_NAME:
      layer = getattr(eqn.invars[0], "val", None)
      marks.append((times, None if layer is None else int(np.asarray(layer))))
      continue
    name = eqn.primitive.name
    if name == "scan":
      inner_times = None if times is None else times * int(eqn.params["length"])
    elif name in ("while", "cond"):
      inner_times = None
    else:
      inner_times = times
    for sub in _subjaxprs(eqn):
      marks += _layer_marks(sub, inner_times)
  return marks


def _check_layers(name: str, config: PoolConfig, marks: list) -> None:
  """Every layer of the pool written once per step by `paged_attention` (`marks`)."""
  num_layers = config.num_layers
  if not marks:
    raise ModelContractError(
        f"{name} never calls paged_attention: each attention layer must write its K/V "
        f"and attend through paged_attention(q, k, v, pages, layer, meta, impl=impl, "
        f"interpret=interpret) (or paged_kv.model.PagedAttention) and pass the returned "
        f"pages on; the pool has {num_layers} layers")
  if any(times is None for times, _ in marks):
    return  # under a while loop or a cond: how often is not known statically
  if all(layer is not None for _, layer in marks):
    written = sorted(layer for times, layer in marks for _ in range(times))
    if written != list(range(num_layers)):
      missing = sorted(set(range(num_layers)) - set(written))
      twice = sorted({l for l in written if written.count(l) > 1})
      raise ModelContractError(
          f"{name} writes pool layers {sorted(set(written))} through paged_attention; the "
          f"pool has {num_layers} (layers never written: {missing}, written more than once: "
          f"{twice}): build the pool with the model's layer count")
    return
  total = sum(times for times, _ in marks)
  if total != num_layers:
    raise ModelContractError(
        f"{name} calls paged_attention {total} times per step (a scan over layers "
        f"counted by its length); the pool has {num_layers} layers: build the pool "
        f"with the model's layer count")


def _trace_step(model: Any, config: PoolConfig, step: tuple, *, impl, interpret,
                indexed: bool):
  """One abstract step traced with layer markers: `(closed jaxpr, out shapes, abstract pages)`."""
  from paged_kv.model import attention  # pylint: disable=import-outside-toplevel
  step_name, num_rows, num_tokens, max_query_len = step
  tokens, pages, meta = _abstract_step(config, num_rows, num_tokens, max_query_len)
  extra = {LOGITS_INDICES: jax.ShapeDtypeStruct((num_rows,), jnp.int32)} if indexed else {}
  token = attention.LAYER_PROBE.set(_mark)
  try:
    jaxpr, out = jax.make_jaxpr(
        lambda t, p, m, kw: model(t, p, m, impl=impl, interpret=interpret, **kw),
        return_shape=True)(tokens, pages, meta, extra)
  except ModelContractError:
    raise
  except Exception as err:  # pylint: disable=broad-except
    raise ModelContractError(
        f"{type(model).__name__} failed on an abstract {step_name} step of the pool's "
        f"shapes (tokens i32[{num_tokens}] in {num_rows} rows, pages {pages.k.shape} "
        f"{config.dtype}): {type(err).__name__}: {err}") from err
  finally:
    attention.LAYER_PROBE.reset(token)
  return jaxpr, out, pages


def check_model(model: Any, config: PoolConfig, *, impl: str | None = "xla",
                interpret: Any = None) -> int:
  """Checks `model` against the contract for a pool of `config`; returns its vocab size.

  Traces (never runs) a decode, a prefill and a mixed step: each must return the
  pages unchanged in structure, shapes and dtypes, logits of its form's shape, and
  write every pool layer once through `paged_attention`. Raises
  `ModelContractError` naming what is wrong and in which step.
  """
  _check_signature(model)
  name = type(model).__name__
  indexed = accepts_logits_indices(model)
  vocab = None
  for step in ABSTRACT_STEPS:
    step_name, num_rows, num_tokens, _ = step
    jaxpr, out, pages = _trace_step(model, config, step, impl=impl, interpret=interpret,
                                    indexed=indexed)
    rows = f"{num_rows} row" + ("s" if num_rows != 1 else "")
    where = f"in an abstract {step_name} step ({rows}, T={num_tokens} tokens)"
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise ModelContractError(f"{name} must return (pages, logits); it "
                               f"returned {jax.tree.structure(out)}")
    new_pages, logits = out
    if isinstance(logits, KVPages):
      raise ModelContractError(f"{name} returned (logits, pages); the "
                               f"contract's order is (pages, logits), the state first as in "
                               f"every paged_kv call (changed in 0.2)")
    want_rows = num_rows if indexed else num_tokens
    if (not hasattr(logits, "shape") or len(logits.shape) != 2
        or logits.shape[0] != want_rows or not jnp.issubdtype(logits.dtype, jnp.floating)):
      got = f"{getattr(logits, 'dtype', type(logits))}{list(getattr(logits, 'shape', ()))}"
      if indexed:
        raise ModelContractError(
            f"{name} takes logits_indices, so its logits must be floating [R={num_rows}, "
            f"vocab] (one row per index, gathered before the output head) {where}; got "
            f"{got}")
      last_only = (hasattr(logits, "shape") and len(logits.shape) == 2
                   and logits.shape[0] == num_rows != num_tokens)
      hint = (": logits for each row's last token only; take the logits_indices keyword "
              "for that, or return every token's" if last_only else "")
      raise ModelContractError(
          f"{name}'s logits must be floating [T={num_tokens}, vocab] (one row per token "
          f"of the step) {where}; got {got}{hint}")
    if not isinstance(new_pages, KVPages):
      raise ModelContractError(f"{name} must return the pool's KVPages "
                               f"first; got {type(new_pages).__name__}")
    for field in ("k", "v"):
      got, want = getattr(new_pages, field), getattr(pages, field)
      if got.shape != want.shape or got.dtype != want.dtype:
        raise ModelContractError(
            f"{name} returned pages.{field} {got.dtype}{list(got.shape)}; "
            f"the pool's are {want.dtype}{list(want.shape)} (hand the pages back unchanged "
            f"in shape: paged_attention writes them in place)")
    _check_layers(name, config, _layer_marks(jaxpr.jaxpr))
    # The pages come in as the 2nd and 3rd inputs (tokens, k, v, ...) and go out first.
    page_ins, page_outs = jaxpr.jaxpr.invars[1:3], jaxpr.jaxpr.outvars[:2]
    if any(o is i for o, i in zip(page_outs, page_ins)):
      raise ModelContractError(
          f"{name} returned the pages it was given {where}: hand back the pages "
          f"paged_attention returned (its K/V writes are in those)")
    if vocab is not None and logits.shape[1] != vocab:
      raise ModelContractError(f"{name}'s vocabulary differs between steps: {vocab} and "
                               f"{logits.shape[1]} {where}")
    vocab = int(logits.shape[1])
  return vocab

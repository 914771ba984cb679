"""The model contract: what `ModelExecutor` and the jitted steps call, checked once.

A model served through `paged_kv.serving.ModelExecutor` (or run by
`paged_kv.model.steps`) is called once per scheduler step, inside jit, as

    pages, logits = model(tokens, pages, meta, impl=impl, interpret=interpret)
    pages, logits = model(tokens, pages, meta, impl=impl, interpret=interpret,
                          logits_indices=idx)      # if the model takes the keyword

  * `tokens`: `i32[T]` the step's new tokens, ragged per `meta.cu_q_lens` (prefill
    chunks and decode tokens of every row together; padded to a power of two);
  * `pages`: the pool's `KVPages` (`[num_layers, num_kv_heads, num_blocks,
    block_size, head_dim]` K and V): each attention layer writes its K/V and reads
    the context through `paged_attention(q, k, v, pages, layer, meta, impl=impl,
    interpret=interpret)` (or `layers.PagedAttention`) and passes the returned
    pages on;
  * `meta`: the step's `StepMetadata` (positions for RoPE, slots, segment tables);
  * `impl`, `interpret`: keywords to forward to `paged_attention` (the executor's
    kernel choice);
  * `logits_indices` (optional, the name vLLM uses): `i32[R]` token indices into
    `[0, T)`, the tokens whose logits the step needs (each row's last one:
    `last_token_index(meta.cu_q_lens, T)`, so `R = B`). A model whose `__call__`
    names this keyword (a parameter of its own; `**kwargs` does not count) is
    always handed it by the steps and returns logits for those tokens only,
    `f32[R, vocab]`: it gathers the hidden states `x[logits_indices]` BEFORE the
    final norm and the output head, so a prefill chunk of T tokens costs the
    head `R x d_model x vocab`, not `T x d_model x vocab`. A model without the
    keyword keeps working: it returns all `T` rows and the step gathers.
  * returns `(pages, logits)`: the pages after the writes, same shapes and
    dtypes, and floating logits `[T, vocab]` (one row per token), or `[R,
    vocab]` (one per index) for a model that takes `logits_indices`. The pages
    come first, as in every paged_kv call (`fn(state, ...) -> (state, out)`,
    `paged_attention -> (pages, out)`, `PagedAttention -> (pages, y)`).

Which form a model uses is decided from its signature (`accepts_logits_indices`),
statically: the jitted steps read it from the model they rebuild from the static
graph definition while tracing, so it costs nothing per step and each form
compiles its own program.

`check_model` checks a model against this once (its signature, then an abstract
evaluation of one step, `jax.eval_shape`: no compile, no device work) and raises
`ModelContractError` naming what is wrong (the order of paged_kv 0.1,
`(logits, pages)`, included). The contract is the `PagedModel`
protocol, for type checkers.
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
  """Whether `model(..., logits_indices=idx)` is the model's own keyword.

  True iff the signature of `model` (its `__call__`) has a parameter named
  `logits_indices` that can be passed by keyword; a catch-all `**kwargs` does not
  count (such a model may drop it and return every token's logits). A model whose
  signature cannot be read is taken not to accept it. Static: the same answer for
  every instance of a class, so the steps decide it while tracing.
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


def _abstract_step(config: PoolConfig, num_tokens: int) -> tuple:
  """Abstract `(tokens, pages, meta)` of a decode step of `num_tokens` rows."""
  shape = (config.num_layers, config.num_kv_heads, config.num_blocks, config.block_size,
           config.head_dim)
  page = jax.ShapeDtypeStruct(shape, config.jnp_dtype)
  pages = KVPages(k=page, v=page)
  b, t, s = num_tokens, num_tokens, config.max_segments
  i32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32)
  meta = StepMetadata(seq_ids=i32(b), positions=i32(t), slot_mapping=i32(t),
                      cu_q_lens=i32(b + 1), seg_block=i32(b, s), seg_start=i32(b, s),
                      seg_length=i32(b, s), num_segments=i32(b), seq_lens=i32(b),
                      num_decodes=i32(), num_prefills=i32(), max_query_len=1)
  return i32(t), pages, meta


def check_model(model: Any, config: PoolConfig, *, impl: str | None = "xla",
                interpret: Any = None, num_tokens: int = 8) -> int:
  """Checks `model` against the contract for a pool of `config`; returns its vocab size.

  The signature first, then one abstract step (`jax.eval_shape` of a decode step of
  `num_tokens` rows: traced, neither compiled nor run), whose result must be
  `(pages, logits [num_tokens, vocab] floating)` with the pages' structure, shapes
  and dtypes unchanged. A model that takes `logits_indices` is handed
  `i32[num_tokens // 2]` indices in that step (fewer than the tokens, so a model
  that ignores them is caught) and must return `[num_tokens // 2, vocab]` logits.

  Raises:
    ModelContractError: naming what is wrong (an exception the model raised while
      traced is chained).
  """
  _check_signature(model)
  tokens, pages, meta = _abstract_step(config, num_tokens)
  indexed = accepts_logits_indices(model)
  num_rows = max(1, num_tokens // 2) if indexed else num_tokens
  extra = {LOGITS_INDICES: jax.ShapeDtypeStruct((num_rows,), jnp.int32)} if indexed else {}
  try:
    out = jax.eval_shape(
        lambda t, p, m, kw: model(t, p, m, impl=impl, interpret=interpret, **kw),
        tokens, pages, meta, extra)
  except ModelContractError:
    raise
  except Exception as err:  # pylint: disable=broad-except
    raise ModelContractError(
        f"{type(model).__name__} failed on an abstract step of the pool's shapes (tokens "
        f"i32[{num_tokens}], pages {pages.k.shape} {config.dtype}): "
        f"{type(err).__name__}: {err}") from err
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise ModelContractError(f"{type(model).__name__} must return (pages, logits); it "
                             f"returned {jax.tree.structure(out)}")
  new_pages, logits = out
  if isinstance(logits, KVPages):
    raise ModelContractError(f"{type(model).__name__} returned (logits, pages); the "
                             f"contract's order is (pages, logits), the state first as in "
                             f"every paged_kv call (changed in 0.2)")
  if (not hasattr(logits, "shape") or len(logits.shape) != 2
      or logits.shape[0] != num_rows or not jnp.issubdtype(logits.dtype, jnp.floating)):
    got = f"{getattr(logits, 'dtype', type(logits))}{list(getattr(logits, 'shape', ()))}"
    if indexed:
      raise ModelContractError(
          f"{type(model).__name__} takes logits_indices, so its logits must be floating "
          f"[R={num_rows}, vocab] (one row per index, gathered before the output head; "
          f"the step had T={num_tokens} tokens); got {got}")
    raise ModelContractError(
        f"{type(model).__name__}'s logits must be floating [T={num_tokens}, vocab] (one "
        f"row per token of the step); got {got}")
  if not isinstance(new_pages, KVPages):
    raise ModelContractError(f"{type(model).__name__} must return the pool's KVPages "
                             f"first; got {type(new_pages).__name__}")
  for name in ("k", "v"):
    got, want = getattr(new_pages, name), getattr(pages, name)
    if got.shape != want.shape or got.dtype != want.dtype:
      raise ModelContractError(
          f"{type(model).__name__} returned pages.{name} {got.dtype}{list(got.shape)}; "
          f"the pool's are {want.dtype}{list(want.shape)} (hand the pages back unchanged "
          f"in shape: paged_attention writes them in place)")
  return int(np.asarray(logits.shape[1]))

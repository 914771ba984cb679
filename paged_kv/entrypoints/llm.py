"""`LLM`: text in, text out, over the scheduler, in a few lines.

  llm = paged_kv.LLM("Llama-3.2-1B")                      # a checkpoint directory
  out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.8, seed=1),
                     max_tokens=32)
  print(out[0].text, out[0].finish_reason)

`LLM` loads a Hugging Face checkpoint and its tokenizer (or takes a model and a
tokenizer), sizes a pool (`pool_blocks`) and serves through the library's
`Scheduler` and `ModelExecutor`: the facade adds no loop of its own. `Engine` is the
single-threaded core it and the server share: prompts in, `CompletionChunk`s out.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Hashable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from paged_kv.core.errors import InvalidArgument
from paged_kv.model.tokenizer import TextStream
from paged_kv.scheduler.parallel_sampling import SampleId
from paged_kv.scheduler.request import Request
from paged_kv.scheduler.sampling_params import SamplingParams
from paged_kv.scheduler.stop_strings import StopStringMatcher, text_until_stop

__all__ = ["Completion", "CompletionChunk", "ContextLengthExceeded", "Engine", "LLM",
           "PoolSizing", "ServedModel", "TokenLogprob", "encode_prompt", "pool_blocks"]

DEFAULT_MAX_TOKENS = 16
"""`max_tokens` when none is given (OpenAI's and vLLM's default for completions)."""

FINISH_REASONS = {"length": "length", "table_full": "length", "stop_token": "stop",
                  "stop_string": "stop", "abort": "abort"}
"""`Request.stop_reason` -> OpenAI's `finish_reason`."""


class ContextLengthExceeded(InvalidArgument):
  """The prompt plus `max_tokens` exceed the model's context (`max_seq_len`)."""

  def __init__(self, prompt_tokens: int, max_tokens: int, max_seq_len: int):
    self.prompt_tokens, self.max_tokens, self.max_seq_len = prompt_tokens, max_tokens, max_seq_len
    super().__init__(
        f"this model's maximum context length is {max_seq_len} tokens; the request asks for "
        f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} to "
        f"generate): shorten the prompt or lower max_tokens")


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
  """One token's logprob and the most likely alternatives at its position.

  Attributes:
    token_id: the token.
    logprob: its log-probability under the model (before sampling's truncation).
    top: `((token_id, logprob), ...)`: the `logprobs` most likely tokens, best first.
    rank: its rank there (1: the most likely) for a prompt token; None if generated.
  """

  token_id: int
  logprob: float
  top: tuple[tuple[int, float], ...]
  rank: int | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
  """One prompt's result (one of its `n` samples).

  Attributes:
    request_id: the request's id (sample i > 0 of an `n > 1` request:
      `parallel_sampling.SampleId(request_id, i)`).
    prompt_token_ids: the prompt's tokens.
    text: the generated text (special tokens skipped); None without a tokenizer.
    token_ids: the generated tokens, a stop token included.
    logprobs: one `TokenLogprob` per generated token when the sampling asked for
      logprobs, else None.
    finish_reason: `"stop"` (a stop token), `"length"` (`max_tokens`, or the
      sequence's table was full) or `"abort"`.
    stop_reason: the scheduler's `Request.stop_reason`.
    sample: which of the prompt's `sampling.n` samples (0 when `n == 1`).
    prompt_logprobs: with `sampling.prompt_logprobs`, one entry per prompt token
      (None for the first, then a `TokenLogprob` with `rank` set); else None.
  """

  request_id: Hashable
  prompt_token_ids: tuple[int, ...]
  text: str | None
  token_ids: tuple[int, ...]
  logprobs: tuple[TokenLogprob, ...] | None
  finish_reason: str
  stop_reason: str
  sample: int = 0
  prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclasses.dataclass(frozen=True)
class CompletionChunk:
  """What one request produced since its previous chunk.

  Attributes:
    request_id: the request's id (a sample's own, as `Completion.request_id`).
    index: its prompt's position in the `stream` / `generate` call's prompts.
    text: the new text ("" while a multi-byte character is incomplete); None
      without a tokenizer.
    token_ids: the new tokens.
    logprobs: their `TokenLogprob`s when asked for, else None.
    finished: whether this is the request's last chunk.
    finish_reason: as `Completion.finish_reason` on the last chunk, else None.
    num_tokens: the request's generated tokens so far, these included.
    sample: which of its prompt's `sampling.n` samples (0 when `n == 1`).
    prompt_logprobs: on the last chunk, as `Completion.prompt_logprobs`; else None.
  """

  request_id: Hashable
  index: int
  text: str | None
  token_ids: tuple[int, ...]
  logprobs: tuple[TokenLogprob, ...] | None
  finished: bool
  finish_reason: str | None
  num_tokens: int
  sample: int = 0
  prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclasses.dataclass(frozen=True)
class PoolSizing:
  """How `pool_blocks` sized a pool (`LLM.sizing`); `block_bytes` counts all layers,
  `budget_bytes` is None when `num_blocks` was given, `rule` says which branch decided."""

  num_blocks: int
  block_bytes: int
  budget_bytes: int | None
  rule: str


def pool_blocks(*, block_bytes: int, block_size: int, max_seq_len: int, max_batch: int,
                num_blocks: int | None = None, kv_cache_bytes: int | None = None,
                free_bytes: int | None = None, memory_fraction: float = 0.8) -> PoolSizing:
  """The pool's blocks: `num_blocks` if given, else a byte budget over one block's bytes.

  The budget is `kv_cache_bytes`, or `memory_fraction` of `free_bytes` (free device
  memory after the weights; `LLM` defaults the fraction to 0.8 on an accelerator,
  0.25 on a CPU host). The count is clamped to at most twice what `max_batch`
  full-length sequences hold (the second half for the prefix cache).

  Raises:
    InvalidArgument: a non-positive size, or a budget below one full-length sequence
      (the message names the bytes needed).
  """
  for name, value in (("block_bytes", block_bytes), ("block_size", block_size),
                      ("max_seq_len", max_seq_len), ("max_batch", max_batch)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
  per_seq = -(-max_seq_len // block_size)
  if num_blocks is not None:
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= per_seq:
      raise InvalidArgument(f"num_blocks must be an int above the {per_seq} blocks of one "
                            f"{max_seq_len}-token sequence, got {num_blocks!r}")
    return PoolSizing(num_blocks, block_bytes, None, "num_blocks given")
  if kv_cache_bytes is not None:
    budget, rule = int(kv_cache_bytes), "kv_cache_bytes given"
  elif free_bytes is not None:
    if not 0.0 < memory_fraction <= 1.0:
      raise InvalidArgument(f"memory_fraction must lie in (0, 1], got {memory_fraction!r}")
    budget = int(memory_fraction * free_bytes)
    rule = f"{memory_fraction:g} of {free_bytes} free bytes"
  else:
    raise InvalidArgument("the device's free memory is unknown: pass num_blocks or "
                          "kv_cache_bytes")
  fit = budget // block_bytes
  if fit < per_seq + 1:
    raise InvalidArgument(
        f"{budget} bytes for the KV cache ({rule}) hold {fit} blocks of {block_bytes} "
        f"bytes; one {max_seq_len}-token sequence needs {per_seq + 1}: lower max_seq_len or "
        f"give more memory")
  cap = 2 * max_batch * per_seq + 1
  if fit > cap:
    return PoolSizing(cap, block_bytes, budget, f"{rule}, capped at twice {max_batch} "
                                                f"full-length sequences")
  return PoolSizing(fit, block_bytes, budget, rule)


def _sample(request_id: Hashable) -> int:
  return request_id.index if isinstance(request_id, SampleId) else 0


def _is_ids(x: Any) -> bool:
  return isinstance(x, (list, tuple, np.ndarray)) and all(
      isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in x)


def encode_prompt(prompt: str | Sequence[int], *, tokenizer: Any, vocab_size: int) -> list[int]:
  """A prompt's token ids: text through `tokenizer`, ids checked against the vocabulary.

  Raises:
    InvalidArgument: empty, not text or ints, an id outside [0, vocab_size), or text
      without a tokenizer.
  """
  if isinstance(prompt, str):
    if tokenizer is None:
      raise InvalidArgument("this model has no tokenizer: pass prompts as token ids")
    ids = tokenizer.encode(prompt)
  elif _is_ids(prompt):
    ids = [int(t) for t in prompt]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
      raise InvalidArgument(f"prompt token ids must lie in [0, {vocab_size}), got {bad[:5]}")
  else:
    raise InvalidArgument(f"a prompt is a str or a sequence of int token ids, got "
                          f"{type(prompt).__name__}")
  if not ids:
    raise InvalidArgument("empty prompt")
  return ids


def check_context(num_prompt_tokens: int, max_tokens: int, max_seq_len: int) -> None:
  """Raises `ContextLengthExceeded` if the prompt plus `max_tokens` exceed `max_seq_len`."""
  if num_prompt_tokens + max_tokens > max_seq_len:
    raise ContextLengthExceeded(num_prompt_tokens, max_tokens, max_seq_len)


class _Tracker:
  """One request's progress as the engine hands it out."""

  __slots__ = ("req", "index", "stream", "sent", "done", "with_logprobs", "top", "final_only",
               "final_text")

  def __init__(self, req: Request, index: int, stream: Any, top: int, *,
               final_only: bool = False, final_text: bool = False):
    self.req, self.index, self.stream = req, index, stream
    self.sent, self.done = 0, False
    self.with_logprobs, self.top = req.sampling is not None and req.sampling.logprobs > 0, top
    self.final_only = final_only  # one chunk, when the request finishes
    self.final_text = final_text  # that chunk's text decoded then, all at once


class Engine:
  """The single-threaded core of `LLM` and of the server: requests in, chunks out.

  One thread at a time (the scheduler steps JAX programs on donated state). `step`
  returns the chunks one scheduler step produced, in submit order.
  """

  def __init__(self, scheduler: Any, tokenizer: Any, *, max_seq_len: int, vocab_size: int,
               eos_token_ids: Iterable[int] = ()):
    self.scheduler = scheduler
    self.tokenizer = tokenizer
    self.max_seq_len = max_seq_len
    self.vocab_size = vocab_size
    self.eos_token_ids = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
    self._live: dict[Hashable, _Tracker] = {}
    self._changed: list[Hashable] = []
    self._ids = itertools.count()
    previous = scheduler.on_step

    def on_step(report: Any) -> None:
      changed = self._changed
      for rid, _ in report.tokens:
        changed.append(rid)
      for r in report.finished:
        changed.append(r.request_id)
      if previous is not None:
        previous(report)

    scheduler.on_step = on_step

  @property
  def num_live(self) -> int:
    """Requests added and not finished (or aborted) yet."""
    return len(self._live)

  @property
  def has_work(self) -> bool:
    """Whether a `step` would serve anything."""
    return bool(self._live) or not self.scheduler.idle

  def encode(self, prompt: str | Sequence[int]) -> list[int]:
    """As `encode_prompt`, with this engine's tokenizer and vocabulary."""
    return encode_prompt(prompt, tokenizer=self.tokenizer, vocab_size=self.vocab_size)

  def check_context(self, num_prompt_tokens: int, max_tokens: int) -> None:
    """Raises `ContextLengthExceeded` if the prompt plus `max_tokens` exceed the context."""
    check_context(num_prompt_tokens, max_tokens, self.max_seq_len)

  def add(self, prompt_ids: Sequence[int], sampling: SamplingParams | None = None, *,
          max_tokens: int = DEFAULT_MAX_TOKENS, request_id: Hashable | None = None,
          index: int = 0, detokenize: bool = True, final_only: bool = False) -> Hashable:
    """Queues one request; returns its id (a fresh `"req-<n>"` unless given).

    The checkpoint's end-of-sequence ids join `sampling.stop_token_ids` unless
    `ignore_eos`. With `sampling.n > 1` each sample is a live request with its own
    chunks. `detokenize=False`: chunks carry ids only (the caller decodes).
    `final_only=True`: one chunk when it finishes, its text decoded once.

    Raises:
      ContextLengthExceeded: prompt plus `max_tokens` beyond `max_seq_len`.
      InvalidArgument: a bad `max_tokens`, a repeated id, anything `Scheduler.submit`
        refuses (nothing is queued then).
    """
    if not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool) or (
        max_tokens < 1):
      raise InvalidArgument(f"max_tokens must be a positive int, got {max_tokens!r}")
    if sampling is None:
      sampling = SamplingParams()
    elif not isinstance(sampling, SamplingParams):
      raise InvalidArgument(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    self.check_context(len(prompt_ids), int(max_tokens))
    if self.eos_token_ids and not getattr(sampling, "ignore_eos", False):
      stops = tuple(dict.fromkeys(tuple(sampling.stop_token_ids) + self.eos_token_ids))
      sampling = dataclasses.replace(sampling, stop_token_ids=stops)
    rid = f"req-{next(self._ids)}" if request_id is None else request_id
    if rid in self._live:
      raise InvalidArgument(f"request id {rid!r} is in use")
    req = Request(rid, np.asarray(prompt_ids, np.int32), int(max_tokens), sampling=sampling)
    self.scheduler.submit(req)
    text = self.tokenizer is not None and detokenize
    for r in (req, *req.samples):
      stream = None
      if text and not final_only:  # the text ends before a stop string
        stream = (StopStringMatcher(self.tokenizer, sampling.stop) if sampling.stop
                  else self.tokenizer.stream())
      self._live[r.request_id] = _Tracker(r, index, stream, sampling.logprobs,
                                          final_only=final_only, final_text=text and final_only)
    return rid

  def abort(self, request_id: Hashable) -> CompletionChunk | None:
    """Ends a live request now, releasing its blocks; its last chunk, or None if unknown."""
    tracker = self._live.get(request_id)
    if tracker is None:
      return None
    if not tracker.req.done:
      self.scheduler.abort(request_id)
    return self._chunk(tracker)

  def step(self) -> list[CompletionChunk]:
    """One scheduler step (when it has work); the chunks of requests that got tokens
    or finished, here or between steps."""
    chunks = [self._chunk(t) for t in list(self._live.values()) if t.req.done]
    if not self.scheduler.idle:
      self._changed = []
      self.scheduler.step()
      self.scheduler.take_finished()  # the engine's trackers hold what it needs
      seen: set = set()
      changed = []
      for rid in self._changed:
        tracker = self._live.get(rid)
        if tracker is not None and rid not in seen and (not tracker.final_only
                                                         or tracker.req.done):
          seen.add(rid)
          changed.append(tracker)
      texts = self._one_token_texts(changed)
      chunks += [self._chunk(t, text) for t, text in zip(changed, texts)]
    return chunks

  @staticmethod
  def _one_token_texts(trackers: list[_Tracker]) -> list[str | None]:
    """Decodes together the trackers that got one token through a plain `TextStream`;
    None for the others."""
    out: list[str | None] = [None] * len(trackers)
    one = [i for i, t in enumerate(trackers)
           if type(t.stream) is TextStream and len(t.req.output) == t.sent + 1]  # pylint: disable=unidiomatic-typecheck
    if len(one) > 1:
      texts = TextStream.add_each([trackers[i].stream for i in one],
                                  [trackers[i].req.output[-1] for i in one])
      for i, text in zip(one, texts):
        out[i] = text
    return out

  def completion(self, req: Request, text: str | None) -> Completion:
    """The `Completion` of a finished request, its text given (its chunks' texts)."""
    logprobs = None
    if req.sampling is not None and req.sampling.logprobs > 0:
      logprobs = tuple(self._logprob(req, i, req.sampling.logprobs)
                       for i in range(len(req.output)))
    return Completion(req.request_id, tuple(int(t) for t in req.prompt), text,
                      tuple(int(t) for t in req.output), logprobs,
                      FINISH_REASONS.get(req.stop_reason, req.stop_reason), req.stop_reason,
                      _sample(req.request_id), self.prompt_logprobs(req))

  @staticmethod
  def prompt_logprobs(req: Request) -> tuple[TokenLogprob | None, ...] | None:
    """As `Completion.prompt_logprobs` (a sample's are its prompt's)."""
    req = req.sample_of or req
    sp = req.sampling
    if sp is None or sp.prompt_logprobs is None:
      return None
    got = req.prompt_logprobs or ()
    out: list[TokenLogprob | None] = [None]
    for t in range(1, int(req.prompt.size)):
      entry = got[t] if t < len(got) else None
      out.append(None if entry is None else TokenLogprob(
          int(req.prompt[t]), float(entry[0]),
          tuple((int(i), float(v)) for i, v in entry[2]), int(entry[1])))
    return tuple(out)

  def request(self, request_id: Hashable) -> Request | None:
    """The live request of this id (the scheduler's object), or None."""
    tracker = self._live.get(request_id)
    return None if tracker is None else tracker.req

  @staticmethod
  def _logprob(req: Request, i: int, top: int) -> TokenLogprob:
    logprob, alternatives = req.logprobs[i]
    return TokenLogprob(int(req.output[i]), float(logprob),
                        tuple((int(t), float(lp)) for t, lp in list(alternatives)[:top]))

  def _chunk(self, tracker: _Tracker, text: str | None = None) -> CompletionChunk:
    """The chunk of `tracker`'s tokens since its last one (`text` if decoded already)."""
    req = tracker.req
    new = req.output[tracker.sent:]
    start, tracker.sent = tracker.sent, len(req.output)
    if text is None and tracker.stream is not None:
      text = "".join([tracker.stream.add(t) for t in new])
    logprobs = None
    if tracker.with_logprobs:
      logprobs = tuple(self._logprob(req, i, tracker.top)
                       for i in range(start, start + len(new)))
    finished = req.done
    prompt_logprobs = None
    if finished:
      if tracker.stream is not None:
        text += tracker.stream.flush()
      elif tracker.final_text:
        stops = req.sampling.stop if req.sampling is not None else ()
        text = (text_until_stop(self.tokenizer, req.output, stops) if stops
                else self.tokenizer.decode(req.output))
      del self._live[req.request_id]
      prompt_logprobs = self.prompt_logprobs(req)
    return CompletionChunk(req.request_id, tracker.index, text, tuple(map(int, new)),
                           logprobs, finished,
                           FINISH_REASONS.get(req.stop_reason, req.stop_reason)
                           if finished else None, len(req.output), _sample(req.request_id),
                           prompt_logprobs)


class LLM:
  """Generate text from a checkpoint directory, or from a model and a tokenizer.

  Attributes:
    engine: the `Engine` (scheduler, tokenizer, live requests).
    scheduler: the `Scheduler` underneath.
    tokenizer: the `paged_kv.model.tokenizer.Tokenizer`, or None.
    max_seq_len: the longest prompt + output it serves.
    sizing: how the pool was sized (`PoolSizing`).
    model_name: the checkpoint directory's name, or "model".
    model_config: the model's config (a `LlamaConfig` for a checkpoint).
    model_type: config.json's `model_type` ("llama", "mistral", "qwen2"), or None.
  """

  def __init__(self, checkpoint: str | os.PathLike | None = None, *, model: Any = None,
               tokenizer: Any = None, max_seq_len: int | None = None, dtype: str | None = None,
               eos_token_ids: Iterable[int] | None = None, max_batch: int = 32,
               block_size: int = 16, num_blocks: int | None = None,
               kv_cache_bytes: int | None = None, memory_fraction: float | None = None,
               scheduler_config: Any = None, impl: str | None = None, warmup: bool = False,
               model_name: str | None = None, prompt_logprobs: bool = False):
    """Loads (or takes) the model, sizes the pool and builds the scheduler.

    Args:
      checkpoint: a Hugging Face Llama/Mistral/Qwen2 directory (config.json,
        *.safetensors, tokenizer.json); or None with `model`.
      model: an NNX model meeting `paged_kv.model.contract` whose `config` has
        `num_layers`, `num_kv_heads`, `head_dim`, `dtype` and `vocab_size`.
      tokenizer: a `Tokenizer` for `model` (None: prompts are token ids, no text out).
      max_seq_len: the longest prompt + output; default the checkpoint's
        `max_position_embeddings` (needed with `model`).
      dtype: the checkpoint's dtype (default its `torch_dtype`).
      eos_token_ids: tokens that end every request (default: the tokenizer's and
        the checkpoint's).
      num_blocks, kv_cache_bytes, memory_fraction: the pool's size (`pool_blocks`).
      scheduler_config: default `SchedulerConfig(max_batch=..., max_logprobs=20)`;
        its `max_seq_len` is set to the context.
      impl: the attention path (`None`: `paged_kv.model.default_impl()`).
      warmup: compile every program of the serving path now.
      prompt_logprobs: serve `SamplingParams.prompt_logprobs` (False: refused).

    Raises:
      InvalidArgument: no such directory, neither or both of `checkpoint` and
        `model`, a pool that cannot hold one full-length sequence.
      UnsupportedCheckpoint, CheckpointMismatch: from the checkpoint loader.
    """
    # pylint: disable=import-outside-toplevel
    import jax
    import paged_kv
    from paged_kv.core import device_memory
    from paged_kv.model import llama
    from paged_kv.scheduler.executor import ModelExecutor
    from paged_kv.scheduler.scheduler import Scheduler
    from paged_kv.scheduler.scheduler_config import SchedulerConfig
    if (checkpoint is None) == (model is None):
      raise InvalidArgument("LLM takes a checkpoint directory or a model, one of the two")
    eos: tuple[int, ...] = ()
    self.model_type = None
    if checkpoint is not None:
      from paged_kv.model import hf_checkpoint
      from paged_kv.model.tokenizer import Tokenizer
      path = Path(checkpoint)
      if not path.is_dir():
        raise InvalidArgument(f"checkpoint directory {str(path)!r} does not exist"
                              if not path.exists() else f"{str(path)!r} is not a directory")
      ckpt = hf_checkpoint.load_checkpoint(path, dtype=dtype, max_seq_len=max_seq_len)
      model, model_config, max_seq_len = ckpt.model, ckpt.config, ckpt.max_seq_len
      if tokenizer is None and (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_dir(path)
      eos = ckpt.eos_token_ids
      model_name = model_name or path.name
      self.model_type = ckpt.model_type
    else:
      model_config = getattr(model, "config", None)
      if not all(hasattr(model_config, a) for a in ("num_layers", "num_kv_heads", "head_dim",
                                                    "dtype", "vocab_size")):
        raise InvalidArgument("model.config must have num_layers, num_kv_heads, head_dim, "
                              "dtype and vocab_size (e.g. a LlamaConfig)")
      if max_seq_len is None:
        raise InvalidArgument("LLM(model=...) needs max_seq_len (the model's context)")
    if tokenizer is not None:
      eos = tuple(tokenizer.eos_token_ids) + tuple(eos)
    if eos_token_ids is not None:
      eos = tuple(eos_token_ids)
    self.model_name = model_name or "model"
    self.model_config = model_config
    self.tokenizer = tokenizer
    self.max_seq_len = int(max_seq_len)
    config = scheduler_config or SchedulerConfig(max_batch=max_batch, max_logprobs=20)
    config = dataclasses.replace(config, max_seq_len=self.max_seq_len)
    unsized = llama.pool_config_for(model_config, num_blocks=2, block_size=block_size)
    on_accelerator = jax.devices()[0].platform != "cpu"
    fraction = memory_fraction if memory_fraction is not None else (
        0.8 if on_accelerator else 0.25)
    need_free = num_blocks is None and kv_cache_bytes is None
    self.sizing = pool_blocks(
        block_bytes=unsized.block_bytes, block_size=block_size, max_seq_len=self.max_seq_len,
        max_batch=config.max_batch, num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes,
        free_bytes=device_memory.free_bytes() if need_free else None, memory_fraction=fraction)
    per_seq = -(-self.max_seq_len // block_size)
    pool_config = llama.pool_config_for(
        model_config, num_blocks=self.sizing.num_blocks, block_size=block_size,
        max_seqs=config.max_batch, max_segments=per_seq + 2, base_pool_fraction=0.0)
    self.scheduler = Scheduler(paged_kv.BlockPool(pool_config),
                               ModelExecutor(model, pool_config, impl=impl,
                                             tokenizer=tokenizer,
                                             prompt_logprobs=prompt_logprobs), config)
    # Chunks of requests a `stream` iterator waits for, produced by another one's step.
    self._buffered: dict[Hashable, list[CompletionChunk]] = {}
    self.engine = Engine(self.scheduler, tokenizer, max_seq_len=self.max_seq_len,
                         vocab_size=int(model_config.vocab_size), eos_token_ids=eos)
    if warmup:
      self.scheduler.warmup(progress=False)

  @property
  def attention_impl(self) -> str:
    """The decode attention path in use: `impl` if given, else `default_impl`'s pick."""
    from paged_kv.model import default_impl  # pylint: disable=import-outside-toplevel
    impl = self.scheduler.executor.kernel_args.get("impl")
    if impl is not None:
      return impl
    c, pool = self.model_config, self.scheduler.pool.config
    return default_impl(num_q_heads=getattr(c, "num_q_heads", None),
                        num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
                        block_size=pool.block_size, dtype=pool.dtype)

  # ------------------------------------------------------------------ requests
  def _requests(self, prompts: Any, sampling: Any, max_tokens: Any
                ) -> list[tuple[list[int], SamplingParams | None, int]]:
    """(prompt ids, sampling, max_tokens) per prompt, all checked before any is queued."""
    if isinstance(prompts, str) or _is_ids(prompts):
      prompts = [prompts]
    elif not isinstance(prompts, (list, tuple)) or not prompts:
      raise InvalidArgument("prompts must be a str, a list of token ids, or a non-empty list "
                            "of those")
    n = len(prompts)
    per = lambda value: list(value) if isinstance(value, (list, tuple)) else [value] * n
    samplings = per(sampling)
    limits = per(DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
    if len(samplings) != n or len(limits) != n:
      raise InvalidArgument(f"{n} prompts, {len(samplings)} samplings, {len(limits)} "
                            f"max_tokens: give one, or one per prompt")
    out = []
    for p, s, m in zip(prompts, samplings, limits):
      ids = self.engine.encode(p)
      if not isinstance(m, (int, np.integer)) or isinstance(m, bool) or m < 1:
        raise InvalidArgument(f"max_tokens must be a positive int, got {m!r}")
      self.engine.check_context(len(ids), int(m))
      out.append((ids, s, int(m)))
    return out

  def stream(self, prompts: Any, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
             *, max_tokens: int | Sequence[int] | None = None) -> Iterator[CompletionChunk]:
    """Submits the prompts and yields their chunks as the steps produce them.

    Args:
      prompts: a str, a list of token ids, or a list of those.
      sampling: one `SamplingParams` for all, one per prompt, or None (greedy).
      max_tokens: tokens to generate per prompt (default `DEFAULT_MAX_TOKENS`).

    Yields:
      `CompletionChunk`s; each request's last has `finished=True`. Closing the
      iterator early aborts the requests not finished.

    Raises:
      ContextLengthExceeded, InvalidArgument: when called, before anything is queued
        (the requests are queued when the iteration starts).
    """
    planned = self._requests(prompts, sampling, max_tokens)
    return (chunk for chunk, _ in self._run(planned))

  def _run(self, planned: list, *, final_only: bool = False
           ) -> Iterator[tuple[CompletionChunk, Request]]:
    """Queues `planned` and yields (chunk, request) until all finished."""
    engine = self.engine
    reqs: dict[Hashable, Request] = {}
    try:
      for i, (p, s, m) in enumerate(planned):
        req = engine.request(engine.add(p, s, max_tokens=m, index=i, final_only=final_only))
        for r in (req, *req.samples):
          reqs[r.request_id] = r
    except BaseException:
      for rid in reqs:
        engine.abort(rid)
      raise
    pending = set(reqs)
    buffered = self._buffered
    for rid in pending:
      buffered[rid] = []
    try:
      while pending:
        # Chunks another iterator's steps produced for these requests, then the last
        # chunk of a request aborted between two chunks, else a step of our own.
        out = [c for rid in pending for c in buffered[rid]]
        for rid in pending:
          buffered[rid] = []
        out += [engine.abort(rid) for rid in pending if reqs[rid].done
                and engine.request(rid) is not None]
        if not out:
          for chunk in engine.step():
            if chunk.request_id in pending:
              out.append(chunk)
            elif chunk.request_id in buffered:  # another iterator's request
              buffered[chunk.request_id].append(chunk)
        for chunk in out:
          if chunk.finished:
            pending.discard(chunk.request_id)
            del buffered[chunk.request_id]
          yield chunk, reqs[chunk.request_id]
    finally:
      for rid in pending:
        engine.abort(rid)
        buffered.pop(rid, None)

  def generate(self, prompts: Any,
               sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
               max_tokens: int | Sequence[int] | None = None) -> list[Completion]:
    """Runs the prompts to the end; one `Completion` per prompt and sample, in order.

    Arguments and errors as `stream`'s (nothing is queued on an error).
    """
    texts: dict[tuple[int, int], list[str]] = {}
    done: dict[tuple[int, int], Completion] = {}
    for chunk, req in self._run(self._requests(prompts, sampling, max_tokens),
                                final_only=True):
      key = (chunk.index, chunk.sample)
      if chunk.text is not None:
        texts.setdefault(key, []).append(chunk.text)
      if chunk.finished:
        text = "".join(texts.get(key, [])) if self.tokenizer is not None else None
        done[key] = self.engine.completion(req, text)
    return [done[k] for k in sorted(done)]

  def abort(self, request_id: Hashable) -> None:
    """Ends a request and its samples now (a sample's id: that sample alone); its last
    chunks come next from `stream`. Unknown or finished ids are ignored."""
    req = self.engine.request(request_id)
    for r in () if req is None else (req, *req.samples):
      if not r.done:
        self.scheduler.abort(r.request_id)


@dataclasses.dataclass(frozen=True)
class ServedModel:
  """What a server's front needs of the `LLM` it serves: picklable, no model inside,
  so the engine may run in another process."""

  model_name: str
  max_seq_len: int
  vocab_size: int
  max_logprobs: int
  tokenizer: Any = None
  sizing: PoolSizing | None = None

  @classmethod
  def of(cls, llm: LLM) -> "ServedModel":
    return cls(llm.model_name, llm.max_seq_len, llm.engine.vocab_size,
               llm.scheduler.config.max_logprobs, llm.tokenizer, llm.sizing)

  def encode(self, prompt: str | Sequence[int]) -> list[int]:
    """As `Engine.encode`."""
    return encode_prompt(prompt, tokenizer=self.tokenizer, vocab_size=self.vocab_size)

  def check_context(self, num_prompt_tokens: int, max_tokens: int) -> None:
    """As `Engine.check_context`."""
    check_context(num_prompt_tokens, max_tokens, self.max_seq_len)

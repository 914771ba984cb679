"""The OpenAI API's request and response bodies, as plain dicts, for the HTTP server.

No web framework here (`paged_kv.entrypoints.api_server` is the FastAPI app): this module
checks a request body and turns it into prompts and `SamplingParams`
(`parse_completion`, `parse_chat`), renders a checkpoint's chat template
(`ChatTemplate`, jinja2 in a sandbox, as transformers' `apply_chat_template`
does), and builds the response and stream-chunk bodies. A malformed request
raises `BadRequest` naming the field (the server answers 400 with OpenAI's error
body).

Sampling fields (`sampling_from_body`, the one place they are mapped):
  * mapped now: `temperature` (OpenAI's default 1.0), `top_p`, `top_k`, `min_p`,
    `seed`, `max_tokens` (`max_completion_tokens` for chat), `logprobs` /
    `top_logprobs`, `stop_token_ids` (a vLLM extension);
  * `n`: the choices per prompt (`SamplingParams.n`: the prompt is computed once and
    its blocks shared, `paged_kv.scheduler.parallel_sampling`); choice `index` is
    prompt * n + sample, as OpenAI's and vLLM's;
  * passed by name to `SamplingParams` (vLLM's fields; a field it lacked would be
    refused with a 400 naming it): `presence_penalty`, `frequency_penalty`,
    `repetition_penalty`, `min_tokens`, `logit_bias`, `ignore_eos`,
    `prompt_logprobs` (served by a server started with `--enable-prompt-logprobs`,
    else refused at `submit`; not with `stream`, as vLLM; the answer is vLLM's:
    `prompt_logprobs` in each completion choice, at the top of a chat response, a
    list with None for the first token, then `{token id: {logprob, rank,
    decoded_token}}` of the prompt's token and the top ones, `prompt_logprobs_json`),
    `stop`;
  * refused: `best_of` other than unset or `n` (vLLM's V1 engine dropped it too),
    `echo`, `suffix`, tools and function calls, `response_format` other than text;
    any field the API does not have.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paged_kv.core.errors import InvalidArgument
from paged_kv.entrypoints.llm import TokenLogprob
from paged_kv.scheduler.sampling_params import SamplingParams

__all__ = ["BadRequest", "ChatTemplate", "ParsedRequest", "parse_chat", "parse_completion",
           "sampling_from_body"]

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions `logprobs`
MAX_CHAT_TOP_LOGPROBS = 20  # ... for /v1/chat/completions `top_logprobs`
MAX_N = 128  # OpenAI's limit of `n`

# Fields passed to `SamplingParams` by name once it has them: field -> its "unset" values.
PASS_THROUGH = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
                "repetition_penalty": (1, 1.0), "min_tokens": (0,), "logit_bias": ({},),
                "ignore_eos": (False,), "prompt_logprobs": (), "stop": ("", [])}

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stream",
           "stream_options", "stop_token_ids", "n", "best_of", "user", *PASS_THROUGH}
_COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "suffix"}
_CHAT_FIELDS = _COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                          "response_format", "tools", "tool_choice", "functions",
                          "function_call", "parallel_tool_calls"}


class BadRequest(InvalidArgument):
  """A request the API refuses (HTTP 400, or `status`).

  Attributes:
    param: the field at fault, or None.
    status: the HTTP status (400; 404 for an unknown model).
    code: OpenAI's error code, or None.
  """

  def __init__(self, message: str, *, param: str | None = None, status: int = 400,
               code: str | None = None):
    super().__init__(message)
    self.param, self.status, self.code = param, status, code


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
  """A checked request.

  Attributes:
    prompts: one entry per prompt: text, or token ids.
    sampling: the `SamplingParams` of every prompt.
    max_tokens: tokens to generate per prompt (None: the rest of the context).
    stream: answer with server-sent events.
    include_usage: a last stream chunk with the token counts.
    logprobs: top logprobs per token to return (None: no logprobs).
  """

  prompts: tuple
  sampling: SamplingParams
  max_tokens: int | None
  stream: bool
  include_usage: bool
  logprobs: int | None


def _check_fields(body: Any, allowed: set) -> dict:
  if not isinstance(body, dict):
    raise BadRequest("the request body must be a JSON object")
  unknown = sorted(set(body) - allowed)
  if unknown:
    raise BadRequest(f"unknown field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}",
                     param=unknown[0])
  return body


def _number(body: dict, name: str, low: float, high: float, default: Any) -> Any:
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
      or not low <= value <= high:
    raise BadRequest(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}", param=name)
  return value


def _int(body: dict, name: str, low: int, high: int | None, default: Any) -> Any:
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, int) or value < low or (
      high is not None and value > high):
    bound = f"[{low}, {high}]" if high is not None else f">= {low}"
    raise BadRequest(f"{name} must be an integer {bound}, got {value!r}", param=name)
  return value


def _is_unset(value: Any, unset: tuple) -> bool:
  return value is None or any(type(value) is type(u) and value == u for u in unset)


def sampling_from_body(body: dict, *, logprobs: int, max_logprobs: int) -> SamplingParams:
  """The request's `SamplingParams` (see the module docstring for which fields).

  Raises:
    BadRequest: a field out of range, or one `SamplingParams` does not support yet.
  """
  n = _int(body, "n", 1, MAX_N, 1)
  best_of = body.get("best_of")
  if best_of is not None and best_of != n:
    raise BadRequest(f"best_of={best_of!r} is not supported (vLLM's V1 engine dropped it "
                     f"too): ask for n={best_of!r} choices and pick among them",
                     param="best_of")
  if logprobs > max_logprobs:
    raise BadRequest(f"at most {max_logprobs} logprobs per token are served, got {logprobs}",
                     param="logprobs")
  kwargs: dict[str, Any] = dict(
      temperature=float(_number(body, "temperature", 0.0, 2.0, 1.0)),
      top_p=float(_number(body, "top_p", 0.0, 1.0, 1.0)),
      top_k=_int(body, "top_k", -1, None, 0),
      min_p=float(_number(body, "min_p", 0.0, 1.0, 0.0)),
      seed=_int(body, "seed", 0, 2**32 - 1, None), logprobs=logprobs, n=n)
  if kwargs["top_k"] == -1:  # vLLM's spelling of "all"
    kwargs["top_k"] = 0
  if kwargs["top_p"] == 0.0:
    raise BadRequest("top_p must be above 0", param="top_p")
  stop_ids = body.get("stop_token_ids")
  if stop_ids is not None:
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids):
      raise BadRequest("stop_token_ids must be a list of non-negative integers",
                       param="stop_token_ids")
    kwargs["stop_token_ids"] = tuple(stop_ids)
  supported = {f.name for f in dataclasses.fields(SamplingParams)}
  for name, unset in PASS_THROUGH.items():
    value = body.get(name)
    if _is_unset(value, unset):
      continue
    if name not in supported:
      raise BadRequest(f"{name} is not supported yet by this server (SamplingParams has no "
                       f"{name})", param=name)
    if name == "logit_bias" and isinstance(value, dict):
      try:
        value = {int(k): float(v) for k, v in value.items()}
      except (TypeError, ValueError):
        raise BadRequest("logit_bias maps token ids to numbers", param=name) from None
    elif name == "stop":
      value = (value,) if isinstance(value, str) else tuple(value)
    kwargs[name] = value
  try:
    return SamplingParams(**kwargs)
  except InvalidArgument as err:
    raise BadRequest(str(err)) from None


def _stream_options(body: dict) -> tuple[bool, bool]:
  stream = body.get("stream", False)
  if stream is None:
    stream = False
  if not isinstance(stream, bool):
    raise BadRequest(f"stream must be a boolean, got {stream!r}", param="stream")
  options = body.get("stream_options")
  if options is None:
    return stream, False
  if not stream:
    raise BadRequest("stream_options is only allowed with stream=true", param="stream_options")
  if not isinstance(options, dict) or set(options) - {"include_usage"}:
    raise BadRequest("stream_options takes only include_usage", param="stream_options")
  usage = options.get("include_usage", False)
  if not isinstance(usage, bool):
    raise BadRequest("stream_options.include_usage must be a boolean", param="stream_options")
  return stream, usage


def _no_stream_prompt_logprobs(body: dict, stream: bool) -> None:
  if stream and body.get("prompt_logprobs") is not None:
    raise BadRequest("prompt_logprobs are not available when stream=true (as vLLM's)",
                     param="prompt_logprobs")


def check_model(body: dict, served: str) -> None:
  """Raises `BadRequest` (404) unless `model` names the served model (or is absent)."""
  model = body.get("model")
  if model is not None and model != served:
    raise BadRequest(f"the model {model!r} does not exist; this server serves {served!r}",
                     param="model", status=404, code="model_not_found")


def parse_completion(body: Any, *, served: str, max_logprobs: int) -> ParsedRequest:
  """A `/v1/completions` body, checked (prompt: a string, a list of strings, a list of
  token ids, or a list of lists of token ids)."""
  body = _check_fields(body, _COMPLETION_FIELDS)
  check_model(body, served)
  for name in ("echo",):
    if body.get(name):
      raise BadRequest(f"{name} is not supported", param=name)
  if body.get("suffix"):
    raise BadRequest("suffix is not supported", param="suffix")
  prompt = body.get("prompt")
  is_id = lambda t: isinstance(t, int) and not isinstance(t, bool)
  if isinstance(prompt, str):
    prompts = (prompt,)
  elif isinstance(prompt, list) and prompt and all(is_id(t) for t in prompt):
    prompts = (tuple(prompt),)
  elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
    prompts = tuple(prompt)
  elif isinstance(prompt, list) and prompt and all(
      isinstance(p, list) and p and all(is_id(t) for t in p) for p in prompt):
    prompts = tuple(tuple(p) for p in prompt)
  else:
    raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a "
                     "list of lists of token ids (none empty)", param="prompt")
  logprobs = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS, None)
  stream, usage = _stream_options(body)
  _no_stream_prompt_logprobs(body, stream)
  sampling = sampling_from_body(body, logprobs=logprobs or 0, max_logprobs=max_logprobs)
  max_tokens = _int(body, "max_tokens", 1, None, 16)
  return ParsedRequest(prompts, sampling, max_tokens, stream, usage, logprobs)


def _message_text(i: int, message: Any) -> dict:
  if not isinstance(message, dict) or not isinstance(message.get("role"), str):
    raise BadRequest(f"messages[{i}] must be an object with a string role", param="messages")
  content = message.get("content")
  if isinstance(content, list):
    parts = []
    for part in content:
      if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
          part.get("text"), str):
        raise BadRequest(f"messages[{i}].content: only text parts are supported",
                         param="messages")
      parts.append(part["text"])
    content = "\n".join(parts)
  if content is not None and not isinstance(content, str):
    raise BadRequest(f"messages[{i}].content must be a string or a list of text parts",
                     param="messages")
  return dict(message, content=content if content is not None else "")


def parse_chat(body: Any, *, served: str, max_logprobs: int) -> tuple[ParsedRequest, list]:
  """A `/v1/chat/completions` body, checked; returns it and its messages (the prompt
  is rendered by the chat template later)."""
  body = _check_fields(body, _CHAT_FIELDS)
  check_model(body, served)
  for name in ("tools", "functions", "function_call"):
    if body.get(name):
      raise BadRequest(f"{name} is not supported", param=name)
  if body.get("tool_choice") not in (None, "none"):
    raise BadRequest("tool_choice is not supported", param="tool_choice")
  fmt = body.get("response_format")
  if fmt is not None and fmt != {"type": "text"}:
    raise BadRequest("response_format: only {\"type\": \"text\"} is supported",
                     param="response_format")
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise BadRequest("messages must be a non-empty list", param="messages")
  messages = [_message_text(i, m) for i, m in enumerate(messages)]
  want = body.get("logprobs")
  if want is not None and not isinstance(want, bool):
    raise BadRequest("logprobs must be a boolean", param="logprobs")
  top = _int(body, "top_logprobs", 0, MAX_CHAT_TOP_LOGPROBS, None)
  if top is not None and not want:
    raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")
  logprobs = (top or 0) if want else None
  stream, usage = _stream_options(body)
  _no_stream_prompt_logprobs(body, stream)
  # The sampled token's logprob comes with the top list: ask for at least one.
  sampling = sampling_from_body(body, logprobs=max(logprobs, 1) if logprobs is not None else 0,
                                max_logprobs=max_logprobs)
  max_tokens = _int(body, "max_completion_tokens", 1, None, None)
  if max_tokens is None:
    max_tokens = _int(body, "max_tokens", 1, None, None)
  return ParsedRequest((None,), sampling, max_tokens, stream, usage, logprobs), messages


# ---------------------------------------------------------------------- chat templates
def _special_text(value: Any) -> str | None:
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


class ChatTemplate:
  """A checkpoint's chat template, rendered with jinja2 as transformers renders it.

  The template comes from `chat_template.jinja`, else `chat_template.json`, else
  `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates:
  `"default"`). Rendered in jinja2's immutable sandbox with `trim_blocks` and
  `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter and the
  `raise_exception` and `strftime_now` globals; variables `messages`,
  `add_generation_prompt` (True), `bos_token` and `eos_token` (the tokenizer's
  special tokens as text). The rendered text holds the special tokens, so it is
  encoded without adding more (`add_special_tokens=False`).
  """

  def __init__(self, source: str, *, bos_token: str | None = None,
               eos_token: str | None = None):
    # pylint: disable=import-outside-toplevel
    from paged_kv.model import optional_import
    jinja2 = optional_import.require("jinja2", needed_for="a chat template", extra="server")
    from jinja2 import ext, sandbox

    def raise_exception(message: str):
      raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:
      return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                        sort_keys=sort_keys)

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    self._jinja2 = jinja2
    self.source = source
    self.template = env.from_string(source)
    self.bos_token, self.eos_token = bos_token, eos_token

  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> "ChatTemplate | None":
    """The template of a checkpoint directory, or None when it has none."""
    path = Path(path)
    config = {}
    if (path / "tokenizer_config.json").is_file():
      config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    source = None
    if (path / "chat_template.jinja").is_file():
      source = (path / "chat_template.jinja").read_text(encoding="utf-8")
    elif (path / "chat_template.json").is_file():
      source = json.loads((path / "chat_template.json").read_text(encoding="utf-8")).get(
          "chat_template")
    else:
      source = config.get("chat_template")
    if isinstance(source, list):
      named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
      source = named.get("default")
    if not isinstance(source, str):
      return None
    return cls(source, bos_token=_special_text(config.get("bos_token")),
               eos_token=_special_text(config.get("eos_token")))

  def render(self, messages: Sequence[dict]) -> str:
    """The prompt text of `messages`, ending with the assistant's turn.

    Raises:
      BadRequest: the template refused the messages (its `raise_exception`, or a
        rendering error), with its message.
    """
    try:
      return self.template.render(messages=list(messages), add_generation_prompt=True,
                                  bos_token=self.bos_token or "", eos_token=self.eos_token or "")
    except self._jinja2.exceptions.TemplateError as err:
      raise BadRequest(f"the chat template refused the messages: {err}",
                       param="messages") from None


# ---------------------------------------------------------------------- responses
def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
  """OpenAI's error body."""
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def _token_text(tokenizer: Any, token_id: int) -> str:
  return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else str(token_id)


def completion_logprobs(tokenizer: Any, logprobs: Sequence[TokenLogprob] | None,
                        text_offset: int) -> dict | None:
  """The legacy completions `logprobs` object of some tokens."""
  if logprobs is None:
    return None
  tokens, token_logprobs, top, offsets = [], [], [], []
  offset = text_offset
  for lp in logprobs:
    text = _token_text(tokenizer, lp.token_id)
    tokens.append(text)
    token_logprobs.append(lp.logprob)
    top.append({_token_text(tokenizer, t): v for t, v in lp.top})
    offsets.append(offset)
    offset += len(text)
  return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
          "text_offset": offsets}


def chat_logprobs(tokenizer: Any, logprobs: Sequence[TokenLogprob] | None,
                  top: int) -> dict | None:
  """The chat `logprobs` object (`{"content": [...]}`) of some tokens."""
  if logprobs is None:
    return None

  def entry(token_id: int, logprob: float) -> dict:
    text = _token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

  return {"content": [dict(entry(lp.token_id, lp.logprob),
                           top_logprobs=[entry(t, v) for t, v in lp.top[:top]])
                      for lp in logprobs]}


def prompt_logprobs_json(tokenizer: Any, entries: Sequence[TokenLogprob | None] | None
                         ) -> list | None:
  """vLLM's `prompt_logprobs` of a response: per prompt token None (the first), or
  `{str(token id): {"logprob", "rank", "decoded_token"}}` of the prompt's token and the
  most likely ones there."""
  if entries is None:
    return None
  out: list = []
  for e in entries:
    if e is None:
      out.append(None)
      continue
    d = {str(t): {"logprob": v, "rank": r, "decoded_token": _token_text(tokenizer, t)}
         for r, (t, v) in enumerate(e.top, start=1)}
    d.setdefault(str(e.token_id), {"logprob": e.logprob, "rank": e.rank,
                                   "decoded_token": _token_text(tokenizer, e.token_id)})
    out.append(d)
  return out


def completion_choice(index: int, chunk_text: str, finish_reason: str | None,
                      logprobs: dict | None) -> dict:
  return {"index": index, "text": chunk_text, "logprobs": logprobs,
          "finish_reason": finish_reason}

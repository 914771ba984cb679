"""A generation request as the scheduler sees it: its inputs (checked and frozen at
`Scheduler.submit`) and its progress (written by the scheduler): `Request`, `Phase`,
`RequestQueues` (a scheduler's requests by phase) and `UnknownRequest`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Hashable

import numpy as np

from paged_kv.core.errors import InvalidArgument, PagedKVError
from paged_kv.scheduler.running_rows import HOT_FIELDS, RunningList, RunningRows
from paged_kv.scheduler.sampling_params import SamplingParams
from paged_kv.scheduler.swap import SwappedKV
from radix.tree import check_namespace

_I32 = np.iinfo(np.int32)


class UnknownRequest(PagedKVError, KeyError):
  """`Scheduler.abort` of an id no unfinished request holds."""

  def __str__(self) -> str:  # KeyError's repr of the message, otherwise
    return str(self.args[0]) if self.args else ""




def is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _as_token_array(x, what: str) -> np.ndarray:
  """A 1-D int32 copy of integer tokens; refuses floats, bools, 2-D and values outside int32."""
  a = np.asarray(x)
  if a.ndim != 1:
    raise InvalidArgument(f"{what} must be a 1-D array of integer tokens, got shape {a.shape}")
  if a.size and (a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer)):
    raise InvalidArgument(f"{what} must hold integer tokens, got dtype {a.dtype}")
  if a.size and (int(a.min()) < _I32.min or int(a.max()) > _I32.max):
    raise InvalidArgument(f"{what} has tokens outside int32: {int(a.min())}..{int(a.max())}")
  return a.astype(np.int32)


class Phase(enum.Enum):
  WAITING = "waiting"
  RUNNING = "running"
  SWAPPED = "swapped"
  FINISHED = "finished"


def _progress(default):
  """A progress field: the scheduler's to set, not a constructor argument."""
  return dataclasses.field(default=default, init=False)


_REQUEST_INPUTS = frozenset(("request_id", "prompt", "max_new_tokens", "namespace",
                             "forced_output", "sampling"))


@dataclasses.dataclass
class Request:
  """One generation request and its progress.

  Attributes:
    request_id: caller's id (unique among unfinished requests).
    prompt: `i32[n]` prompt tokens (n >= 1).
    max_new_tokens: tokens to generate (>= 1).
    namespace: prefix-cache namespace (tenant / adapter), a typed key
      (`radix.tree.check_namespace`): `1`, `1.0` and `True` never share.
    arrival: arrival time in the caller's unit, for the caller's reports.
    forced_output: `i32[max_new_tokens]` tokens to emit instead of samples (trace replay).
    sampling: how its tokens are drawn (`SamplingParams`; None: greedy).

  `Scheduler.submit` freezes these inputs (assigning one raises). The other fields
  are progress, the scheduler's to write: `phase`, `output`, `seq_id` (its row),
  `num_cached` (tokens whose K/V is in the pool, `in_flight` unread ones included),
  `*_step` / `*_time`, `logprobs` (per token: its logprob and the top n),
  `prompt_logprobs` (`prompt_positions`), `samples` (`parallel_sampling`), and
  `stop_reason`: `"length"`, `"stop_token"`, `"stop_string"`, `"table_full"` (its
  row is full), `"pool_exhausted"` (alone, no block: `error` says why) or `"abort"`.
  While it runs, the hot fields live in `running_rows.RunningRows` arrays.
  """

  request_id: Hashable
  prompt: np.ndarray
  max_new_tokens: int
  namespace: Hashable = "default"
  arrival: float = 0.0
  forced_output: np.ndarray | None = None
  sampling: SamplingParams | None = None
  # Progress (set by the scheduler).
  phase: Phase = _progress(Phase.WAITING)
  output: list = dataclasses.field(default_factory=list, init=False)
  seq_id: int | None = _progress(None)
  num_cached: int = _progress(0)
  prefill_target: int = _progress(0)
  lock_node: object = _progress(None)
  swapped: SwappedKV | None = _progress(None)
  hit_tokens: int = _progress(0)
  num_preemptions: int = _progress(0)
  stop_reason: str = _progress("")  # see above
  error: Exception | None = _progress(None)  # the typed error of a "pool_exhausted" stop
  submit_step: int = _progress(-1)
  admit_step: int = _progress(-1)
  first_token_step: int = _progress(-1)
  finish_step: int = _progress(-1)
  submit_time: float = _progress(-1.0)  # the scheduler's clock at submit
  admit_time: float = _progress(-1.0)  # ... at the first admission (queue time = admit - submit)
  first_token_time: float = _progress(-1.0)
  last_token_time: float = _progress(-1.0)
  finish_time: float = _progress(-1.0)
  logprobs: list = dataclasses.field(default_factory=list, init=False)
  prompt_logprobs: list | None = _progress(None)  # with `sampling.prompt_logprobs` (below)
  stop_ids: frozenset = _progress(frozenset())  # the tokens that end it (set at submit)
  sample_seed: int = _progress(0)  # its sampling seed (`sampling.seed`, else the scheduler's)
  in_flight: int = _progress(0)  # tokens sampled on the device, not read yet
  carry_row: int = _progress(-1)  # its row in the newest unread step (where its next input token is)
  epoch: int = _progress(0)  # bumped when its unread tokens are dropped (finish, preemption, abort)
  # `sampling.n > 1` (`paged_kv.scheduler.parallel_sampling`): the request's other samples,
  # and a sample's first request (whose row it shares); compare/repr off: they point at
  # each other.
  samples: tuple = dataclasses.field(default=(), init=False, compare=False, repr=False)
  sample_of: "Request | None" = dataclasses.field(default=None, init=False, compare=False,
                                                  repr=False)

  _frozen = False  # set by `_freeze` (`Scheduler.submit`)
  _rows = None  # the `running_rows.RunningRows` holding its hot fields while bound
  _slot = -1  # its slot there

  def __post_init__(self):
    self.validate()

  def _freeze(self) -> None:
    """Read-only copies of the input arrays, and no more assignments to the inputs."""
    prompt = np.array(self.prompt, copy=True)
    prompt.flags.writeable = False
    self.prompt = prompt
    if self.forced_output is not None:
      forced = np.array(self.forced_output, copy=True)
      forced.flags.writeable = False
      self.forced_output = forced
    object.__setattr__(self, "_frozen", True)

  def validate(self) -> None:
    """Checks and normalizes the caller's fields (`Scheduler.submit` calls it again).
    Raises `InvalidArgument`, or `radix.InvalidNamespaceError` for the namespace."""
    self.prompt = _as_token_array(self.prompt, f"request {self.request_id!r}: prompt")
    if self.prompt.size < 1:
      raise InvalidArgument(f"request {self.request_id!r}: empty prompt")
    if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
      raise InvalidArgument(f"request {self.request_id!r}: max_new_tokens must be a positive "
                            f"int, got {self.max_new_tokens!r}")
    self.max_new_tokens = int(self.max_new_tokens)
    check_namespace(self.namespace)
    if self.sampling is not None and not isinstance(self.sampling, SamplingParams):
      raise InvalidArgument(f"request {self.request_id!r}: sampling must be a SamplingParams "
                            f"or None, got {type(self.sampling).__name__}")
    if self.forced_output is not None:
      self.forced_output = _as_token_array(self.forced_output,
                                           f"request {self.request_id!r}: forced_output")
      if self.forced_output.size < self.max_new_tokens:
        raise InvalidArgument(f"request {self.request_id!r}: forced_output shorter than "
                              f"max_new_tokens")

  @property
  def tokens(self) -> np.ndarray:
    """Prompt followed by the output so far."""
    return np.concatenate([self.prompt, np.asarray(self.output, np.int32)])

  @property
  def done(self) -> bool:
    return self.phase == Phase.FINISHED


def _input_field(name: str, read) -> property:
  """The attribute of input field `name`, stored under `_<name>` and assignable until
  the request is frozen (only inputs are guarded: progress writes stay plain)."""
  key = "_" + name

  def assign(self, value) -> None:
    if self._frozen:
      raise InvalidArgument(f"request {self.request_id!r} was submitted: its {name} is "
                            f"frozen (submit a new Request)")
    object.__setattr__(self, key, value)

  return property(read, assign, doc=f"The request's `{name}` (an input).")


Request.request_id = _input_field("request_id", lambda self: self._request_id)
Request.prompt = _input_field("prompt", lambda self: self._prompt)
Request.max_new_tokens = _input_field("max_new_tokens", lambda self: self._max_new_tokens)
Request.namespace = _input_field("namespace", lambda self: self._namespace)
Request.forced_output = _input_field("forced_output", lambda self: self._forced_output)
Request.sampling = _input_field("sampling", lambda self: self._sampling)
assert all(isinstance(getattr(Request, name), property) for name in _REQUEST_INPUTS)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Request)}


def _hot_field(name: str) -> property:
  """The attribute of progress field `name`: in the instance under `_<name>`, or
  while the request is bound to a `RunningRows` slot, in the table's column (one
  storage: the step's array passes and every reader agree)."""
  key, default = "_" + name, _DEFAULTS[name]

  def read(self):
    rows = self._rows
    if rows is None:
      return self.__dict__.get(key, default)
    return getattr(rows, name)[self._slot].item()

  def write(self, value) -> None:
    rows = self._rows
    if rows is None:
      self.__dict__[key] = value
    else:
      getattr(rows, name)[self._slot] = value

  return property(read, write, doc=f"The request's `{name}` (progress).")


def _read_seq_id(self):
  rows = self._rows
  if rows is None:
    return self.__dict__.get("_seq_id")
  v = rows.seq_id[self._slot].item()
  return None if v < 0 else v


def _write_seq_id(self, value) -> None:
  rows = self._rows
  if rows is None:
    self.__dict__["_seq_id"] = value
  else:
    rows.seq_id[self._slot] = -1 if value is None else value


def _write_stop_reason(self, value) -> None:
  self.__dict__["_stop_reason"] = value
  rows = self._rows
  if rows is not None:
    rows.stopped[self._slot] = bool(value)


for _name in HOT_FIELDS:
  if _name != "seq_id":
    setattr(Request, _name, _hot_field(_name))
Request.seq_id = property(_read_seq_id, _write_seq_id, doc="Its pool row while running.")
Request.stop_reason = property(lambda self: self.__dict__.get("_stop_reason", ""), _write_stop_reason,
                               doc="Why it finished (see the class docstring).")



@dataclasses.dataclass(eq=False)
class RequestQueues:
  """A scheduler's requests by phase; `unshared`: `id()`s of queued requests to admit
  without a cached prefix (`Preemption.unstick`); `rows`: the running ones' hot
  progress as arrays (`running_rows`)."""

  waiting: collections.deque = dataclasses.field(default_factory=collections.deque)
  swapped: collections.deque = dataclasses.field(default_factory=collections.deque)
  running: list = dataclasses.field(default_factory=RunningList)
  finished: list = dataclasses.field(default_factory=list)
  unshared: set = dataclasses.field(default_factory=set)
  rows: RunningRows = dataclasses.field(default_factory=RunningRows)


def drop_in_flight(req: Request) -> None:
  """Forgets the tokens `req` has on the device and not read yet: when they are read,
  they are dropped (the request finished, was aborted or preempted meanwhile)."""
  req.in_flight = 0
  req.carry_row = -1
  req.epoch += 1


def cacheable_tokens(req: Request) -> int:
  """How many of `req.tokens` to store in the prefix cache: those whose K/V its row
  holds (`num_cached`), but never its last output token (pending: sampled, not cached,
  in the synchronous loop) and never a token the host has not read."""
  known = int(req.prompt.size) + len(req.output)
  return min(req.num_cached, known - 1 if req.output else known)


def is_finished(req: Request) -> bool:
  """Whether `req` is done: names its `stop_reason` (`"length"`, `"stop_token"`) the
  first time it is asked, after the output that ends it."""
  if not req.stop_reason:
    if len(req.output) >= req.max_new_tokens:
      req.stop_reason = "length"
    elif req.stop_ids and req.output and req.output[-1] in req.stop_ids:
      req.stop_reason = "stop_token"
  return bool(req.stop_reason)


def check_new(request: Request, submitted, live) -> None:
  """`Scheduler.submit`'s checks of the request itself, `submitted` holding the `id()`s
  of request objects submitted before and `live` the unfinished requests' ids.
  Raises `InvalidArgument` (or `radix.InvalidNamespaceError`); nothing changes."""
  if not isinstance(request, Request):
    raise InvalidArgument(f"submit takes a Request, got {type(request).__name__}")
  if id(request) in submitted:
    raise InvalidArgument(f"request {request.request_id!r} was already submitted (the same "
                          f"Request object); submit a new Request")
  if (request.phase != Phase.WAITING or request.output or request.seq_id is not None
      or request.swapped is not None or request.lock_node is not None):
    raise InvalidArgument(f"request {request.request_id!r} carries progress; submit a new "
                          f"Request")
  request.validate()
  try:
    in_use = request.request_id in live
  except TypeError as e:
    raise InvalidArgument(f"request_id must be hashable, got {request.request_id!r}") from e
  if in_use:
    raise InvalidArgument(f"request id {request.request_id!r} is in use by an unfinished "
                          f"request; ids are unique among live requests")


def seal(request: Request, *, stop_token: int, seed: int, now: float = -1.0,
         step: int = -1) -> None:
  """Freezes a checked request's inputs and fixes its stop tokens (its sampling's and
  the scheduler's `stop_token`, -1: none, unless its sampling has `ignore_eos`), its
  sampling seed (its own, else `seed`), and its `submit_time` / `submit_step`."""
  request._freeze()  # pylint: disable=protected-access
  request.submit_time, request.submit_step = now, step
  sp = request.sampling
  stops = set(sp.stop_token_ids) if sp is not None else set()
  if stop_token >= 0 and not (sp is not None and sp.ignore_eos):
    stops.add(stop_token)
  request.stop_ids = frozenset(stops)
  request.sample_seed = sp.seed if sp is not None and sp.seed is not None else seed % (2**32)

"""`RunningRows`: the running requests' hot progress as arrays (struct of arrays).

A step finds its decode rows, advances them and reads their tokens in a few numpy
passes instead of Python over `Request` objects. While a request is bound to a slot
(`sync`), its `HOT_FIELDS` are properties on the slot: one storage, right whoever
writes it. `gen` tells a slot's binds apart; `n_out` counts `Request.output` (`check`).
"""

from __future__ import annotations

import operator

import numpy as np

from paged_kv.core.errors import InvariantViolation

HOT_FIELDS = ("num_cached", "in_flight", "carry_row", "epoch", "prefill_target", "seq_id",
              "last_token_time")
"""The `Request` fields stored in the table while bound (`seq_id`: -1 for None)."""

NO_STOP, MANY_STOPS = -1, -2
"""`stop_tok` values: no stop token; more than one (checked in Python)."""

_slot_of = operator.attrgetter("_slot")
_last = operator.itemgetter(-1)


def _changes(name: str, *, append: bool = False):
  """`list.<name>`, counted in `version` (not an append: the kept prefix is gone)."""
  method = getattr(list, name)

  def changed(self, *args, **kwargs):
    self.version += 1
    if not append:
      self.kept = 0
    return method(self, *args, **kwargs)

  changed.__name__ = name
  return changed


class RunningList(list):
  """The running requests (`RequestQueues.running`): a `list` that counts its changes
  (`version`) and how many leading entries appends kept since its `owner` marked it
  (`kept`), so `RunningRows.sync` knows in O(1) that nothing changed, or only appends."""

  version = 0
  kept = 0
  owner = None

  append = _changes("append", append=True)
  extend = _changes("extend", append=True)
  __iadd__ = _changes("__iadd__", append=True)
  insert = _changes("insert")
  remove = _changes("remove")
  pop = _changes("pop")
  clear = _changes("clear")
  sort = _changes("sort")
  reverse = _changes("reverse")
  __setitem__ = _changes("__setitem__")
  __delitem__ = _changes("__delitem__")
  __imul__ = _changes("__imul__")


class RunningRows:
  """The table (see the module docstring): columns indexed by slot, `i64[cap]` unless
  said. `HOT_FIELDS` (`last_token_time` f64); `stopped` (bool, the truth of
  `stop_reason`); `n_out` (`len(output)`); `max_new`; `stop_tok` (its one stop
  token, or `NO_STOP` / `MANY_STOPS`); `forced` (bool); `req`, `out`, `rid`
  (object: the request, its `output`, its id); `gen` (binds of the slot so far);
  `bound` (bool); `order` (`i64[n]`: the slots of `running` in order, after `sync`).
  """

  def __init__(self, capacity: int = 64):
    self.order = np.zeros((0,), np.int64)
    self._seen: list = []  # the requests `order` was read from, in order
    self._list: RunningList | None = None  # the list synced last, when a RunningList
    self._version = 0  # its `version` then
    self._free: list[int] = []
    self._cap = 0
    self._alloc(capacity)

  def _alloc(self, cap: int) -> None:
    old = self._cap

    def grow(name, dtype, fill):
      a = np.full((cap,), fill, dtype)
      if old:
        a[:old] = getattr(self, name)
      setattr(self, name, a)

    for name in ("num_cached", "in_flight", "epoch", "prefill_target", "max_new", "gen",
                 "n_out"):
      grow(name, np.int64, 0)
    for name in ("carry_row", "seq_id", "stop_tok"):
      grow(name, np.int64, -1)
    grow("last_token_time", np.float64, -1.0)
    for name in ("stopped", "forced", "bound"):
      grow(name, bool, False)
    for name in ("req", "out", "rid"):
      grow(name, object, None)
    self._free.extend(range(cap - 1, old - 1, -1))  # lowest slots first
    self._cap = cap

  # ------------------------------------------------------------------ binding
  def _kept_prefix(self, running: list) -> int:
    """How many leading requests of `running` are the last sync's, in order (-1: not
    a prefix); O(1) for the `RunningList` it marked unless more than appends changed it."""
    seen = self._seen
    if running is self._list and running.owner is self and (
        running.version == self._version or running.kept >= len(seen)):
      return len(seen)  # unchanged, or appends only, since the mark
    k = min(len(seen), len(running))
    return k if all(map(operator.is_, running[:k], seen[:k])) else -1

  def _mark(self, running: list) -> None:
    self._seen = list(running)
    if isinstance(running, RunningList):
      running.kept, running.owner = len(running), self
      self._list, self._version = running, running.version
    else:
      self._list = None

  def sync(self, running: list) -> np.ndarray:
    """Binds the requests of `running` not bound yet, unbinds those bound that left
    it, and returns `order` (their slots in running order)."""
    n, k = len(running), self._kept_prefix(running)
    if k == len(self._seen) == n:
      return self.order  # the same requests in the same order (their binds stand)
    if k == len(self._seen):  # new requests appended
      order = np.concatenate([self.order, np.fromiter(map(_slot_of, running[k:]), np.int64,
                                                      n - k)])
    else:
      order = np.fromiter(map(_slot_of, running), np.int64, n)
    if n and order.min() < 0:
      for i in np.flatnonzero(order < 0).tolist():
        order[i] = self.bind(running[i])
    present = np.zeros((self._cap,), bool)
    present[order] = True
    stale = self.bound & ~present
    if stale.any():
      for s in np.flatnonzero(stale).tolist():
        self.unbind(self.req[s])
    self.order = order
    self._mark(running)
    return order

  def kept(self, running: list, keep: np.ndarray) -> None:
    """`running` is now the synced list's requests where `keep` (in order): the
    next `sync` starts from their slots without reading them."""
    self.order = self.order[keep]
    self._mark(running)

  def bind(self, req) -> int:
    """Moves `req`'s hot fields into a free slot; returns the slot."""
    if not self._free:
      self._alloc(2 * self._cap)
    s = self._free.pop()
    for name in HOT_FIELDS:  # (the unbound values, through the properties)
      if name != "seq_id":
        getattr(self, name)[s] = getattr(req, name)
    seq = req.seq_id
    self.seq_id[s] = -1 if seq is None else seq
    self.stopped[s] = bool(req.stop_reason)
    d = req.__dict__
    self.max_new[s] = req.max_new_tokens
    self.n_out[s] = len(req.output)
    stops = req.stop_ids
    one = next(iter(stops)) if len(stops) == 1 else -1
    self.stop_tok[s] = NO_STOP if not stops else one if one >= 0 else MANY_STOPS
    self.forced[s] = req.forced_output is not None
    self.req[s], self.out[s], self.rid[s] = req, req.output, req.request_id
    self.gen[s] += 1
    self.bound[s] = True
    d["_rows"], d["_slot"] = self, s
    return s

  def unbind(self, req) -> None:
    """Copies `req`'s hot fields back to the object and frees its slot."""
    s = req._slot  # pylint: disable=protected-access
    d = req.__dict__
    for name in HOT_FIELDS:
      d["_" + name] = getattr(self, name)[s].item()
    if d["_seq_id"] < 0:
      d["_seq_id"] = None
    d["_rows"], d["_slot"] = None, -1
    self.req[s] = self.out[s] = self.rid[s] = None
    self.bound[s] = False
    self._free.append(s)

  @staticmethod
  def appended(req) -> None:
    """Counts one token appended to `req.output` (its `n_out`, while bound)."""
    rows = req._rows  # pylint: disable=protected-access
    if rows is not None:
      rows.n_out[req._slot] += 1  # pylint: disable=protected-access

  # ------------------------------------------------------------------ reads
  def output_lengths(self, slots: np.ndarray) -> np.ndarray:
    """`i64[n]` `len(output)` of the requests in `slots`."""
    return self.n_out[slots]

  def check(self) -> None:
    """Raises InvariantViolation unless each bound slot's `n_out` is `len(output)`."""
    s = np.flatnonzero(self.bound)
    lens = np.fromiter(map(len, self.out[s].tolist()), np.int64, s.size)
    bad = np.flatnonzero(lens != self.n_out[s])
    if bad.size:
      raise InvariantViolation("running rows: " + "; ".join(
          f"request {self.rid[s[i]]!r}: {lens[i]} output tokens, n_out {self.n_out[s[i]]}"
          for i in bad.tolist()))

  def last_tokens(self, slots: np.ndarray) -> np.ndarray:
    """`i64[n]` the last output token of the requests in `slots` (each has one)."""
    return np.array(list(map(_last, self.out[slots].tolist())), np.int64).reshape(-1)

  def stop_hits(self, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """`bool[n]`: `tokens[i]` is a stop token of the request in `slots[i]`."""
    st = self.stop_tok[slots]
    hit = (st == tokens) & (st >= 0)
    many = np.flatnonzero(st == MANY_STOPS)
    if many.size:
      reqs = self.req[slots[many]].tolist()
      hit[many] = [int(t) in r.stop_ids for r, t in zip(reqs, tokens[many].tolist())]
    return hit

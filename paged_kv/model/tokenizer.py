"""A checkpoint's tokenizer: its `tokenizer.json` through `tokenizers` (the `hf` extra; no JAX).

`Tokenizer.from_dir(dir)` also reads the bos/eos ids; `encode` adds the special
tokens the file's post-processor says; `stream()` turns ids into text as they come.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from paged_kv.core.errors import InvalidArgument
from paged_kv.model import optional_import

__all__ = ["TextStream", "Tokenizer"]


def _tokenizers():
  return optional_import.require("tokenizers", needed_for="reading a tokenizer.json", extra="hf")


def _read_json(file: Path) -> dict:
  if not file.is_file():
    return {}
  with open(file, encoding="utf-8") as f:
    data = json.load(f)
  return data if isinstance(data, dict) else {}


def _ids(value: Any) -> tuple[int, ...]:
  values = value if isinstance(value, list) else [value]
  return tuple(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool))


class Tokenizer:
  """Encode and decode with a `tokenizers.Tokenizer`, plus `bos_token_id` and `eos_token_ids`."""

  def __init__(self, tokenizer: Any, *, bos_token_id: int | None = None,
               eos_token_ids: Iterable[int] = ()):
    self._tok = tokenizer
    self.bos_token_id = bos_token_id
    self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

  @classmethod
  def from_file(cls, file: str | os.PathLike, **kwargs) -> "Tokenizer":
    """A `tokenizer.json` file; `bos_token_id` / `eos_token_ids` as keywords."""
    file = Path(file)
    if not file.is_file():
      raise InvalidArgument(f"no tokenizer file at {file}")
    return cls(_tokenizers().Tokenizer.from_file(str(file)), **kwargs)

  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
    """The tokenizer of a checkpoint directory; `InvalidArgument` without a `tokenizer.json`."""
    path = Path(path)
    file = path / "tokenizer.json"
    if not file.is_file():
      raise InvalidArgument(f"{path} has no tokenizer.json (a fast tokenizer file); "
                            f"pass token ids instead")
    tok = _tokenizers().Tokenizer.from_file(str(file))
    bos: int | None = None
    eos: tuple[int, ...] = ()
    for name in ("generation_config.json", "config.json"):
      data = _read_json(path / name)
      if bos is None and _ids(data.get("bos_token_id")):
        bos = _ids(data["bos_token_id"])[0]
      if not eos:
        eos = _ids(data.get("eos_token_id"))
    special = _read_json(path / "tokenizer_config.json")
    for key in ("bos_token", "eos_token"):
      value = special.get(key)
      text = value.get("content") if isinstance(value, dict) else value
      token_id = tok.token_to_id(text) if isinstance(text, str) else None
      if token_id is not None and key == "bos_token" and bos is None:
        bos = token_id
      if token_id is not None and key == "eos_token" and not eos:
        eos = (token_id,)
    return cls(tok, bos_token_id=bos, eos_token_ids=eos)

  @property
  def vocab_size(self) -> int:
    """Ids the tokenizer knows, added tokens included."""
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """`text` to ids (with the special tokens the file's post-processor adds)."""
    if not isinstance(text, str):
      raise InvalidArgument(f"encode takes a str, got {type(text).__name__}")
    return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

  def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
    """Ids to text (special tokens dropped unless `skip_special_tokens=False`)."""
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def decode_batch(self, sequences: list[list[int]], *,
                   skip_special_tokens: bool = True) -> list[str]:
    """`decode` of each id list (Python ints) in one call to the tokenizer."""
    return self._tok.decode_batch(sequences, skip_special_tokens=skip_special_tokens)

  def stream(self) -> "TextStream":
    """A `TextStream` over this tokenizer."""
    return TextStream(self)


class TextStream:
  """Generated ids to text, piece by piece: `add(id)` returns the text it completes.

  Each call decodes only the last piece's ids plus the new ones (vLLM's
  incremental offsets), so neighbour-dependent tokens come out right and a piece
  ending in an incomplete character is held back. The pieces add up to `decode`
  of all ids.
  """

  def __init__(self, tokenizer: Tokenizer):
    self._tok = tokenizer
    self._ids: list[int] = []
    self._start = 0  # the window's first id
    self._read = 0  # ids whose text was returned
    self._seen = ""  # the text of ids[_start:_read]

  def add(self, token_id: int) -> str:
    """Appends one generated id; returns the text it completes ("" while held back)."""
    self._ids.append(int(token_id))
    return self._advance(hold_incomplete=True)

  def flush(self) -> str:
    """What `add` held back (an incomplete character at the end), now."""
    return self._advance(hold_incomplete=False)

  @staticmethod
  def add_each(streams: list["TextStream"], token_ids: Iterable[int]) -> list[str]:
    """`[s.add(t) for s, t in zip(streams, token_ids)]` with one tokenizer call for all windows.

    Streams not sharing one `Tokenizer` with `decode_batch` go one by one. Raises
    `InvalidArgument` (nothing added) unless there is one id per stream.
    """
    token_ids = [int(t) for t in token_ids]
    if len(token_ids) != len(streams):
      raise InvalidArgument(f"{len(streams)} streams, {len(token_ids)} ids")
    tok = streams[0]._tok if streams else None
    if (tok is None or not hasattr(tok, "decode_batch")
        or any(type(s) is not TextStream or s._tok is not tok for s in streams)):  # pylint: disable=unidiomatic-typecheck
      return [s.add(t) for s, t in zip(streams, token_ids)]
    for s, t in zip(streams, token_ids):
      s._ids.append(t)
    texts = tok.decode_batch([s._ids[s._start:] for s in streams])
    out: list[str] = []
    moved: list[TextStream] = []
    for s, text in zip(streams, texts):  # as `_advance(hold_incomplete=True)`
      if text.endswith("\ufffd") or not text.startswith(s._seen):
        out.append("")
        continue
      new = text[len(s._seen):]
      if new:
        s._start, s._read = s._read, len(s._ids)
        moved.append(s)
      out.append(new)
    if moved:
      for s, seen in zip(moved, tok.decode_batch([s._ids[s._start:s._read] for s in moved])):
        s._seen = seen
    return out

  def _advance(self, *, hold_incomplete: bool) -> str:
    ids = self._ids
    text = self._tok.decode(ids[self._start:])
    if (hold_incomplete and text.endswith("\ufffd")) or not text.startswith(self._seen):
      return ""
    new = text[len(self._seen):]
    if new:
      self._start, self._read = self._read, len(ids)
      self._seen = self._tok.decode(ids[self._start:self._read])
    return new


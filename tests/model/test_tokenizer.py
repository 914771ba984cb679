"""The checkpoint tokenizer (issue O item 5): a `tokenizer.json` trained in memory by the
`tokenizers` library round-trips text, takes bos/eos from the checkpoint's JSON files,
and streams generated ids as text without splitting a multi-byte character."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers", reason="the hf extra (pip install 'paged-kv[hf]')")

import paged_kv  # pylint: disable=wrong-import-position
from paged_kv.model.tokenizer import Tokenizer  # pylint: disable=wrong-import-position
from tests.model.hf_files import TEXTS, write_tokenizer  # pylint: disable=wrong-import-position


@pytest.fixture(name="tok_dir")
def _tok_dir(tmp_path):
  write_tokenizer(tmp_path)
  return tmp_path


def test_round_trip(tok_dir):
  tok = Tokenizer.from_dir(tok_dir)
  assert tok.vocab_size == 300
  for text in TEXTS + ["unseen wörds ✓ and digits 12345"]:
    ids = tok.encode(text)
    assert ids[0] == 1  # the file's post-processor adds <s>
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
  assert tok.decode([1, *tok.encode("hi", add_special_tokens=False), 2],
                    skip_special_tokens=False) == "<s>hi</s>"


def test_special_ids_from_the_checkpoint_files(tok_dir):
  assert (Tokenizer.from_dir(tok_dir).bos_token_id, Tokenizer.from_dir(tok_dir).eos_token_ids) \
      == (None, ())
  (tok_dir / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
  tok = Tokenizer.from_dir(tok_dir)
  assert (tok.bos_token_id, tok.eos_token_ids) == (1, (2,))
  (tok_dir / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 0}))
  assert Tokenizer.from_dir(tok_dir).eos_token_ids == (0,)
  # generation_config.json wins, and may list several.
  (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  assert Tokenizer.from_dir(tok_dir).eos_token_ids == (2, 0)


def test_stream_holds_incomplete_characters(tok_dir):
  tok = Tokenizer.from_dir(tok_dir)
  text = "héllo wörld ✓ done"
  ids = tok.encode(text, add_special_tokens=False)
  stream = tok.stream()
  pieces = [stream.add(i) for i in ids]
  assert "".join(pieces) + stream.flush() == text
  assert all("\ufffd" not in p for p in pieces)
  # Byte-level pieces of "✓" (3 bytes) alone decode to U+FFFD: they were held back.
  assert "" in pieces


def test_errors(tmp_path):
  with pytest.raises(paged_kv.InvalidArgument, match="has no tokenizer.json"):
    Tokenizer.from_dir(tmp_path)
  with pytest.raises(paged_kv.InvalidArgument, match="no tokenizer file"):
    Tokenizer.from_file(tmp_path / "tokenizer.json")
  write_tokenizer(tmp_path)
  with pytest.raises(paged_kv.InvalidArgument, match="encode takes a str"):
    Tokenizer.from_dir(tmp_path).encode([1, 2])


def _sentencepiece_style(path):
  """A Llama-2-style `tokenizer.json`: Metaspace pieces, `<0xNN>` byte fallback, and the
  decoder that strips the first piece's leading space."""
  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer as HfTokenizer
  from tokenizers import decoders, models, pre_tokenizers
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
  for b in range(256):
    vocab[f"<0x{b:02X}>"] = len(vocab)
  for piece in ("▁", "▁the", "▁a", "ab", "c", "▁wörld", "é", ".", "▁.", ",", "lo", "▁hel"):
    vocab[piece] = len(vocab)
  tok = HfTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
  path.mkdir(parents=True, exist_ok=True)
  tok.save(str(path / "tokenizer.json"))
  return Tokenizer.from_dir(path)


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_stream_pieces_add_up_to_the_whole_decode(tmp_path, kind):
  """The pieces plus `flush` equal `decode` of all ids, and the pieces so far equal
  the text of the ids so far whenever that text is complete. Byte-level:
  random ids (special ones, bytes that never complete a character included).
  SentencePiece: the ids of random texts (byte fallback for the characters it lacks;
  random byte pieces are not monotone there: a later byte can turn a decoded
  character back into U+FFFD, as can the incomplete bytes of a character that
  follow a byte-fallback piece)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  if kind == "byte_level":
    write_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    draw = lambda: rng.integers(0, tok.vocab_size, int(rng.integers(1, 120))).tolist()
  else:
    tok = _sentencepiece_style(tmp_path)
    chars = list("the a abc wörld héllo ✓ 𝄞 , . ") + ["  "]
    draw = lambda: tok.encode("".join(rng.choice(chars, int(rng.integers(1, 60)))),
                              add_special_tokens=False)
  for _ in range(40):
    ids = draw()
    stream, out = tok.stream(), ""
    for n, i in enumerate(ids, 1):
      out += stream.add(i)
      whole = tok.decode(ids[:n])
      if not whole.endswith("\ufffd"):
        assert out == whole, (ids[:n], out, whole)
    assert out + stream.flush() == tok.decode(ids)


def test_stream_decodes_a_window_not_the_whole_output(tok_dir):
  """A long generation costs each `add` the same: the ids decoded per call stay bounded."""
  tok = Tokenizer.from_dir(tok_dir)
  ids = tok.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
  assert len(ids) > 500
  decoded = []
  tok._tok = _Counting(tok._tok, decoded)  # pylint: disable=protected-access
  stream = tok.stream()
  for i in ids:
    stream.add(i)
  assert max(decoded) <= 8, max(decoded)


class _Counting:
  """A `tokenizers.Tokenizer` that records how many ids each `decode` call got (and
  each `decode_batch` call as `("batch", sequences)`)."""

  def __init__(self, tok, sizes):
    self._tok, self._sizes = tok, sizes

  def decode(self, ids, **kwargs):
    self._sizes.append(len(ids))
    return self._tok.decode(ids, **kwargs)

  def decode_batch(self, sequences, **kwargs):
    self._sizes.append(("batch", len(sequences)))
    return self._tok.decode_batch(sequences, **kwargs)


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece"])
def test_add_each_equals_adding_one_by_one(tmp_path, kind):
  """A step's ids added to many streams at once (two tokenizer calls) give each stream
  the pieces `add` gives it alone, held-back characters included; other streams or
  mixed tokenizers fall back to `add`; a length mismatch adds nothing."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from paged_kv.core.errors import InvalidArgument  # pylint: disable=import-outside-toplevel
  from paged_kv.model.tokenizer import TextStream  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(1)
  if kind == "byte_level":
    write_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
  else:
    tok = _sentencepiece_style(tmp_path)
  outputs = rng.integers(0, tok.vocab_size, (12, 40)).tolist()
  together, alone = [tok.stream() for _ in outputs], [tok.stream() for _ in outputs]
  calls = []
  tok._tok = _Counting(tok._tok, calls)  # pylint: disable=protected-access
  for step in range(40):
    live = [i for i in range(len(outputs)) if rng.random() < 0.8]  # rows come and go
    del calls[:]
    got = TextStream.add_each([together[i] for i in live], [outputs[i][step] for i in live])
    assert len(calls) <= 2 and all(isinstance(c, tuple) for c in calls), calls
    assert got == [alone[i].add(outputs[i][step]) for i in live], step
  assert [s.flush() for s in together] == [s.flush() for s in alone]
  # Streams of two tokenizers: each added alone (one `decode` call each here).
  mixed = [tok.stream(), Tokenizer.from_dir(tmp_path).stream()]
  del calls[:]
  ids = outputs[0][:2]
  assert TextStream.add_each(mixed, ids) == [s.add(i) for s, i in zip(
      [tok.stream(), tok.stream()], ids)]
  assert not any(isinstance(c, tuple) for c in calls), calls
  with pytest.raises(InvalidArgument, match="2 streams, 1 ids"):
    TextStream.add_each(together[:2], [3])
  assert [s.flush() for s in together[:2]] == ["", ""]  # nothing was added

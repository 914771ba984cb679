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

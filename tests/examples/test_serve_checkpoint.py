"""`examples/serve.py --checkpoint DIR --prompt "..."` on a tiny random Llama checkpoint
and byte-level BPE tokenizer the test writes itself: the script (through `paged_kv.LLM`)
streams the prompt and its greedy completion, which must be the dense reference's
tokens, decoded; with `--n=2` the second sample prints after it, the same text. ~15 s alone on 2 cores (the model's compiles). User errors print
`error: <message>` and exit with status 2."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="the hf extra (pip install 'paged-kv[hf]')")
pytest.importorskip("tokenizers", reason="the hf extra (pip install 'paged-kv[hf]')")

from tests.model.hf_files import (  # pylint: disable=wrong-import-position
    LLAMA, write_checkpoint, write_tokenizer)

# The example scripts' smoke runs (subprocesses).
pytestmark = pytest.mark.slow

_ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPT = "the quick brown fox"
NEW_TOKENS = 8


def test_serve_streams_a_checkpoint_completion(tmp_path):
  from paged_kv.model import hf_checkpoint  # pylint: disable=import-outside-toplevel
  from paged_kv.model.reference import generate_dense  # pylint: disable=import-outside-toplevel
  from paged_kv.model.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
  ckpt_dir = tmp_path / "tiny-llama"
  write_checkpoint(ckpt_dir, LLAMA, seed=5,
                   extra={"generation_config.json": {"bos_token_id": 1, "eos_token_id": 2}})
  write_tokenizer(ckpt_dir)
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu",
             PAGED_KV_COMPILE_CACHE=str(tmp_path / "jax_cache"))
  proc = subprocess.run(
      [sys.executable, str(_ROOT / "examples" / "serve.py"), f"--checkpoint={ckpt_dir}",
       f"--prompt={PROMPT}", f"--max_tokens={NEW_TOKENS}", "--block_size=8",
       "--num_blocks=16", "--n=2"], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = proc.stdout
  assert "\n[llama 2 layers float32: " in out, out
  streamed, second = out[:out.rindex("\n[llama")].split("\n[sample 1] ")
  # The dense reference's greedy tokens (up to the first end-of-sequence), decoded.
  tok = Tokenizer.from_dir(ckpt_dir)
  prompt = tok.encode(PROMPT)
  model = hf_checkpoint.load_checkpoint(ckpt_dir).model
  want = generate_dense(model, [prompt], NEW_TOKENS)[0][len(prompt):]
  if 2 in want:
    want = want[:want.index(2) + 1]
  assert streamed == PROMPT + tok.decode(want), (streamed, want)
  assert second == streamed  # greedy: both samples the same
  summary = out[out.rindex("[llama"):]
  assert f"{len(prompt)} prompt tokens, {2 * len(want)} generated" in summary, summary
  assert "(sample 0), 2 samples]" in summary, summary
  assert np.all(np.asarray(want) < LLAMA["vocab_size"])


def _serve(tmp_path, *flags_):
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu",
             PAGED_KV_COMPILE_CACHE=str(tmp_path / "jax_cache"))
  return subprocess.run([sys.executable, str(_ROOT / "examples" / "serve.py"), *flags_],
                        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("flags_, message", [
    (["--prompt=x"], "error: checkpoint directory {missing!r} does not exist"),
    ([], "error: --checkpoint needs --prompt"),
    (["--prompt=the quick", "--max_tokens=5000"], "error: this model's maximum context "
                                                  "length is 2048 tokens"),
    (["--prompt=x", "--top_k=many"], "error: flag --top_k=many"),
])
def test_user_errors_exit_2(tmp_path, flags_, message):
  ckpt = tmp_path / "ckpt"
  write_checkpoint(ckpt, LLAMA)
  write_tokenizer(ckpt)
  missing = str(tmp_path / "missing")
  where = missing if "does not exist" in message else str(ckpt)
  proc = _serve(tmp_path, f"--checkpoint={where}", *flags_)
  assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert message.format(missing=missing) in proc.stderr, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) <= 3, proc.stderr

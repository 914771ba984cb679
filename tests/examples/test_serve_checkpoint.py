"""`examples/serve.py --checkpoint DIR --prompt "..."` (issue O item 5) on a tiny random
Llama checkpoint and byte-level BPE tokenizer the test writes itself: the script
streams the prompt and its greedy completion, which must be the dense reference's
tokens, decoded. ~15 s alone on 2 cores (the model's compiles)."""

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
       f"--prompt={PROMPT}", f"--max_new_tokens={NEW_TOKENS}", "--block_size=8",
       "--num_blocks=16"], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  out = proc.stdout
  assert "\n[llama 2 layers float32: " in out, out
  streamed = out[:out.rindex("\n[llama")]
  # The dense reference's greedy tokens (up to the first end-of-sequence), decoded.
  tok = Tokenizer.from_dir(ckpt_dir)
  prompt = tok.encode(PROMPT)
  model = hf_checkpoint.load_checkpoint(ckpt_dir).model
  want = generate_dense(model, [prompt], NEW_TOKENS)[0][len(prompt):]
  if 2 in want:
    want = want[:want.index(2) + 1]
  assert streamed == PROMPT + tok.decode(want), (streamed, want)
  summary = out[out.rindex("[llama"):]
  assert f"{len(prompt)} prompt tokens, {len(want)} generated" in summary, summary
  assert np.all(np.asarray(want) < LLAMA["vocab_size"])


def test_serve_checkpoint_needs_a_prompt(tmp_path):
  write_checkpoint(tmp_path, LLAMA)
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu",
             PAGED_KV_COMPILE_CACHE=str(tmp_path / "jax_cache"))
  proc = subprocess.run([sys.executable, str(_ROOT / "examples" / "serve.py"),
                         f"--checkpoint={tmp_path}"], cwd=_ROOT, env=env,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0 and "--checkpoint needs --prompt" in proc.stderr, proc.stderr

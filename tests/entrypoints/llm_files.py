"""A tiny chat checkpoint for the facade and server tests: the Llama config of
`tests.model.hf_files` (2 layers, vocab 320), a byte-level BPE tokenizer, and a
`tokenizer_config.json` with a chat template and the `<s>` / `</s>` special tokens.
Needs the `hf` extra (callers `pytest.importorskip` it)."""

from __future__ import annotations

from pathlib import Path

from tests.model.hf_files import LLAMA, write_checkpoint, write_tokenizer

MAX_POSITIONS = 128
# A template in the shape checkpoints ship (bos, a header per role, eos after each turn).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def write_chat_checkpoint(path: Path, *, seed: int = 5) -> Path:
  """Writes the checkpoint into `path`; returns it."""
  write_checkpoint(path, dict(LLAMA, max_position_embeddings=MAX_POSITIONS), seed=seed,
                   extra={"tokenizer_config.json": {"bos_token": "<s>", "eos_token": "</s>",
                                                    "chat_template": CHAT_TEMPLATE}})
  write_tokenizer(path)
  return Path(path)

"""`python -m paged_kv.serve --checkpoint DIR --port N`: an OpenAI-compatible server.

Loads a Hugging Face Llama/Mistral/Qwen2 checkpoint directory into `paged_kv.LLM`
(pool sized from free device memory unless `--num-blocks`) and serves
`/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health` and `/metrics`
(`paged_kv.entrypoints.api_server`; the `server` extra: pip install 'paged-kv[server]').
A user error (no such directory, a bad flag) prints `error: <message>` and exits 2.

Example:
  python -m paged_kv.serve --checkpoint Qwen2-0.5B-Instruct --port 8000
  curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'
"""

from __future__ import annotations

import argparse
import functools
import sys


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m paged_kv.serve",
                              description="An OpenAI-compatible server for a checkpoint.")
  p.add_argument("--checkpoint", required=True, help="a Hugging Face checkpoint directory")
  p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every "
                 "interface)")
  p.add_argument("--port", type=int, default=8000)
  p.add_argument("--served-model-name", default=None, help="the model's name in the API "
                 "(default: the directory's name)")
  p.add_argument("--max-seq-len", type=int, default=None, help="longest prompt + output "
                 "(default: the checkpoint's max_position_embeddings)")
  p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
  p.add_argument("--max-batch", type=int, default=32, help="sequences per step")
  p.add_argument("--block-size", type=int, default=16, help="tokens per block")
  p.add_argument("--num-blocks", type=int, default=None, help="the pool's blocks (default: "
                 "from free device memory, paged_kv.entrypoints.llm.pool_blocks)")
  p.add_argument("--memory-fraction", type=float, default=None, help="share of the free "
                 "device memory for the KV cache (default 0.8 on a GPU, 0.25 on a CPU)")
  p.add_argument("--max-queued", type=int, default=256, help="requests queued or running "
                 "before new ones get HTTP 429")
  p.add_argument("--engine", choices=("thread", "loop", "process"), default="thread",
                 help="where the scheduler runs: its own thread; a task of the HTTP event "
                 "loop (no lock hand-offs; requests are parsed between steps); or a process "
                 "of its own (the model is loaded there; HTTP, tokenizing and detokenizing "
                 "stay here)")
  p.add_argument("--enable-prompt-logprobs", action="store_true", help="serve requests "
                 "asking for prompt_logprobs (vLLM's field; their step programs are compiled "
                 "too)")
  p.add_argument("--no-warmup", action="store_true", help="compile each program on first "
                 "use instead of before serving")
  p.add_argument("--compile-cache-dir", default=None, help="JAX's persistent compilation "
                 "cache (default: $PAGED_KV_COMPILE_CACHE, else ~/.cache/paged_kv/jax)")
  p.add_argument("--log-level", default="info",
                 choices=("critical", "error", "warning", "info", "debug"))
  return p


def main(argv: list[str] | None = None) -> int:
  """Parses flags, loads the checkpoint and serves until interrupted; returns the exit
  status (2 for a user error)."""
  args = _parser().parse_args(argv)
  from pathlib import Path  # pylint: disable=import-outside-toplevel
  if not Path(args.checkpoint).is_dir():
    print(f"error: checkpoint directory {args.checkpoint!r} does not exist"
          if not Path(args.checkpoint).exists() else
          f"error: {args.checkpoint!r} is not a directory", file=sys.stderr)
    return 2
  try:
    # pylint: disable=import-outside-toplevel
    from paged_kv.core.errors import InvalidArgument
    from paged_kv.runtime import compile_cache, host_memory
    from paged_kv.entrypoints import openai_api, api_server as server
    from paged_kv.entrypoints.llm import LLM
  except ModuleNotFoundError as err:
    print(f"error: {err} (pip install 'paged-kv[server]')", file=sys.stderr)
    return 2
  host_memory.return_freed_memory()
  compile_cache.enable_compilation_cache(args.compile_cache_dir)
  print(f"loading {args.checkpoint}" + ("" if args.no_warmup else
        " and compiling every program of the serving path (--no-warmup: on first use)"),
        flush=True)
  try:
    llm = functools.partial(
        LLM, args.checkpoint, max_seq_len=args.max_seq_len, dtype=args.dtype,
        max_batch=args.max_batch, block_size=args.block_size, num_blocks=args.num_blocks,
        memory_fraction=args.memory_fraction, warmup=not args.no_warmup,
        model_name=args.served_model_name, prompt_logprobs=args.enable_prompt_logprobs)
    template = openai_api.ChatTemplate.from_dir(args.checkpoint)
    srv = server.Server(llm, max_queued=args.max_queued, template=template,
                        engine=args.engine)
  except (InvalidArgument, ModuleNotFoundError) as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  sizing = srv.served.sizing
  print(f"serving {srv.model_name} ({sizing.num_blocks} blocks of {args.block_size} "
        f"tokens: {sizing.rule}) at http://{args.host}:{args.port}/v1", flush=True)
  server.serve(srv, host=args.host, port=args.port, log_level=args.log_level)
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Text in, text out: `LLM` and its `Engine`, and the OpenAI-compatible HTTP server.

`llm` (`LLM.generate`, `stream`, `abort`; flax, and the `hf` extra for a checkpoint);
`engine_thread`, `engine_task`, `engine_process` run the engine beside a server (a
thread, the event loop, a process); `openai_api` and `api_server` are the server
(`python -m paged_kv.serve`; the `server` extra). Import the submodules explicitly.
"""

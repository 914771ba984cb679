"""The flags every benchmark script spells the same way, defined once, and the paths they share.

A script calls `define_*` at module level beside its own `flags.DEFINE_*` and defines only
the flags it reads. This module disclaims its definitions (absl's `disclaim_key_flags`),
so each flag belongs to the calling script: `--help` lists it with the script's own flags
and `records.script_flags()` records its value.

  _RECORD = shared_flags.define_record()
  _SEED = shared_flags.define_seed("Workload seed.")
  _CACHE = shared_flags.define_compile_cache()
  ...
  _CACHE.enable()  # in main()
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys

from absl import flags

from benchmarks import records

# pylint: disable=redefined-builtin  (the parameter `help`, as absl names it)

flags.disclaim_key_flags()

REPO = pathlib.Path(__file__).resolve().parents[1]
"""The checkout's root (the directory holding `benchmarks/`)."""


def define_record() -> flags.FlagHolder[str | None]:
  """`--record=PATH`: where the run's JSON record goes (`benchmarks.records`)."""
  return flags.DEFINE_string("record", None, records.RECORD_FLAG_HELP)


def define_seed(help: str = "Random seed.") -> flags.FlagHolder[int]:
  """`--seed` (default 0, at least 0: numpy's generators refuse negative seeds)."""
  return flags.DEFINE_integer("seed", 0, help, lower_bound=0)


def define_repeats(default: int, help: str) -> flags.FlagHolder[int]:
  """`--repeats`: rounds of the measurement (at least 1: a median needs a value)."""
  return flags.DEFINE_integer("repeats", default, help, lower_bound=1)


def define_block_size(help: str = "Tokens per block.") -> flags.FlagHolder[int]:
  """`--block_size` (default 16, at least 1)."""
  return flags.DEFINE_integer("block_size", 16, help, lower_bound=1)


def define_progress(help: str = "Show a progress bar (needs tqdm).") -> flags.FlagHolder[bool]:
  """`--progress` (default on)."""
  return flags.DEFINE_bool("progress", True, help)


@dataclasses.dataclass(frozen=True)
class CompileCacheFlags:
  """`--compile_cache` and `--compile_cache_dir`: JAX's persistent compilation cache
  (`paged_kv.runtime.compile_cache`, imported when used: some scripts time their import)."""
  on: flags.FlagHolder[bool]
  dir: flags.FlagHolder[str | None]

  def directory(self) -> str | None:
    """The cache's directory when on (the flag, $PAGED_KV_COMPILE_CACHE, or the
    default), None when off."""
    if not self.on.value:
      return None
    from paged_kv.runtime import compile_cache  # pylint: disable=import-outside-toplevel
    return (self.dir.value or os.environ.get(compile_cache.ENV_VAR)
            or compile_cache.default_cache_dir())

  def enable(self) -> None:
    """Turns the cache on for this process, if the flags say so."""
    if self.on.value:
      from paged_kv.runtime import compile_cache  # pylint: disable=import-outside-toplevel
      compile_cache.enable_compilation_cache(self.dir.value)


def define_compile_cache(
    help: str = "Use JAX's persistent compilation cache (restarts skip XLA compiles).",
) -> CompileCacheFlags:
  """`--compile_cache` (default on) and `--compile_cache_dir`."""
  return CompileCacheFlags(
      on=flags.DEFINE_bool("compile_cache", True, help),
      dir=flags.DEFINE_string("compile_cache_dir", None, "The cache's directory (default: "
                              "$PAGED_KV_COMPILE_CACHE, else ~/.cache/paged_kv/jax)."))


def shared_traces(script: str | os.PathLike) -> pathlib.Path:
  """`../shared/traces/` beside the checkout that holds `script` (the public traces are
  not shipped; pass the script's `__file__`)."""
  return pathlib.Path(os.path.abspath(script)).parents[2] / "shared" / "traces"


def default_trace(script: str | os.PathLike) -> str:
  """The Mooncake conversation trace in `shared_traces(script)`."""
  return str(shared_traces(script) / "conversation_trace.jsonl")


def rerun_command(script: str | os.PathLike) -> list[str]:
  """The command that starts `script` (a module of `benchmarks/`) again in a child
  process, however the parent was started; run it with `cwd=REPO`."""
  return [sys.executable, "-m", f"benchmarks.{pathlib.Path(script).stem}"]

"""Shows XLA's CPU compiler crashing at the kernel's memory-mapping limit.

Usage: `.venv/bin/python tools/map_limit_repro.py [LEAVE]` (Linux only).

It first measures how many memory mappings one small compiled program holds while its
jitted function is alive, then fills the process's mappings to LEAVE (default 100)
below `vm.max_map_count` with one anonymous mapping whose every other page is made
read-only (each page is then its own mapping), and compiles small programs until it
dies. With JAX 0.12 on x86-64 CPU it
prints `LLVM compilation error: Cannot allocate memory` and the process ends with a
segmentation fault inside `backend_compile_and_load` (exit status 139): the crash a
long test run meets when its workers keep thousands of executables alive.
"""

from __future__ import annotations

import ctypes
import faulthandler
import sys

import jax
import jax.numpy as jnp

_PROT_READ, _PROT_RW = 1, 3
_MAP_PRIVATE_ANON = 0x22
_PAGE = 4096


def mapping_count() -> int:
  with open("/proc/self/maps", "rb") as f:
    return sum(1 for _ in f)


_LIVE = []  # the jitted functions, kept alive as a module-level `jax.jit` would be


def compile_one(i: int) -> None:
  """Compiles and runs a new program of a few operations (a new shape each time)."""
  def f(x, y):
    z = jnp.sort(x) + i
    w = jnp.cumsum(y) * z
    return jnp.where(w > 3, w, z).sum() + jnp.argmax(w)
  _LIVE.append(jax.jit(f))
  _LIVE[-1](jnp.ones(16 + i), jnp.ones(16 + i)).block_until_ready()


def main(leave: int) -> None:
  faulthandler.enable()
  limit = int(open("/proc/sys/vm/max_map_count").read())
  compile_one(0)
  before = mapping_count()
  for i in range(1, 51):
    compile_one(i)
  per_program = (mapping_count() - before) / 50
  print(f"vm.max_map_count {limit}; {per_program:.0f} mappings per compiled program",
        flush=True)

  libc = ctypes.CDLL(None, use_errno=True)
  libc.mmap.restype = ctypes.c_void_p
  libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                        ctypes.c_int, ctypes.c_long]
  libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
  pages = max(0, (limit - mapping_count() - leave) // 2 * 2)
  base = libc.mmap(None, pages * _PAGE, _PROT_RW, _MAP_PRIVATE_ANON, -1, 0)
  if base in (None, ctypes.c_void_p(-1).value):
    raise OSError(ctypes.get_errno(), "mmap failed")
  for p in range(0, pages, 2):
    libc.mprotect(base + p * _PAGE, _PAGE, _PROT_READ)
  print(f"mappings now {mapping_count()}; compiling until the limit", flush=True)
  for i in range(51, 10_000):
    compile_one(i)
    print(f"compiled program {i}: {mapping_count()} mappings", flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)

"""Host memory of a long-running process: hand freed large buffers back to the OS.

glibc's malloc serves allocations above `M_MMAP_THRESHOLD` with `mmap` (returned to
the OS on `free`) and the rest from its heap, which it gives back only from the
top and only past `M_TRIM_THRESHOLD`. Both thresholds are dynamic by default: each
freed mmapped block raises the mmap threshold up to 32 MiB, so after a while the
host buffers of a serving process (swapped-out K/V, a saved cache's arrays, the
buffers XLA:CPU allocates for its programs, the old pool at a shrink's cut) come
from the heap, and the memory they leave behind stays resident. Measured with
`benchmarks/soak_runtime.py --seconds=300` (4,096 blocks, swap preemption, a save every
500 steps, a shrink to 3,072 blocks half-way; 2026-12-02, WORKSPACE_NOTES.md session
8): RSS 469 -> 511 MB with glibc's defaults (x1.09, +26 MB after the cut), 479 -> 477
MB with fixed 64 KiB thresholds, the cut giving the old pool's memory back.

The library changes no process-wide setting on import: the example scripts call
`return_freed_memory()` at the start of `main` (a flag turns it off), and a server
does the same, or sets `MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_` in its
environment (the same thresholds, before the process starts).

    from paged_kv.runtime.host_memory import return_freed_memory
    return_freed_memory()        # fixed 64 KiB thresholds; False where there is no glibc

Cost: an allocation above the threshold is a system call and fresh zeroed pages each
time (the 5-minute soak served as many steps with it: 92,184 vs 88,591).
"""

from __future__ import annotations

import ctypes

from paged_kv.core.errors import InvalidArgument

__all__ = ["DEFAULT_THRESHOLD", "return_freed_memory"]

DEFAULT_THRESHOLD = 64 * 1024  # bytes
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc refuses more (HEAP_MAX / 2 on 64-bit)


def return_freed_memory(mmap_threshold: int = DEFAULT_THRESHOLD,
                        trim_threshold: int | None = None) -> bool:
  """Fixes glibc's thresholds so that freed large buffers go back to the OS.

  Args:
    mmap_threshold: allocations of at least this many bytes are mmapped (and
      unmapped when freed); an int in `[4096, 32 MiB]`. Fixing it also stops
      glibc's dynamic raising of it.
    trim_threshold: free heap top above this many bytes is returned at once
      (default: `mmap_threshold`); an int >= 0.

  Returns:
    True when both settings took effect; False without glibc (e.g. musl, macOS):
    nothing changes then.

  Raises:
    InvalidArgument: a threshold that is not an int in range.
  """
  trim = mmap_threshold if trim_threshold is None else trim_threshold
  for name, value, low, high in (("mmap_threshold", mmap_threshold, 4096, _MAX_MMAP_THRESHOLD),
                                 ("trim_threshold", trim, 0, 2**31 - 1)):
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
      raise InvalidArgument(f"{name} must be an int in [{low}, {high}], got {value!r}")
  try:
    libc = ctypes.CDLL("libc.so.6")
    mallopt = libc.mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
  mallopt.restype = ctypes.c_int
  return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
      mallopt(_M_TRIM_THRESHOLD, trim))

"""Host memory of a long-running process: hand freed large buffers back to the OS.

glibc raises its mmap threshold with every freed mmapped block, so a server's
large host buffers end up on the heap and stay resident. `return_freed_memory()`
fixes the thresholds (scripts call it in `main`, the library never on import);
each large allocation then costs a system call and fresh zeroed pages.
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
  """Fixes glibc's mmap and trim thresholds (bytes) so freed large buffers go back to the OS.

  `mmap_threshold` is an int in `[4096, 32 MiB]`, `trim_threshold` an int >= 0
  (default: `mmap_threshold`), else `InvalidArgument`. Returns False without glibc
  (nothing changes).
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

"""`paged_kv.runtime.host_memory.return_freed_memory`: freed large buffers go back to the OS.

A child process (so the setting stays out of the test process) raises glibc's
dynamic mmap threshold with one large allocation, then allocates 1000 x 96 KiB
buffers with small long-lived allocations between them (the heap cannot be
trimmed from the top), frees the buffers and reports how much stays resident.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from absl.testing import absltest
import pytest

from paged_kv.core.errors import InvalidArgument
from paged_kv.runtime import host_memory

pytestmark = pytest.mark.slow

_PROBE = textwrap.dedent("""
    import ctypes, sys
    import paged_kv  # the same imports in both runs
    from paged_kv.runtime.host_memory import return_freed_memory
    if sys.argv[1] == "1":
      assert return_freed_memory()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
    def rss_kib():
      for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
          return int(line.split()[1])
    big = libc.malloc(8 << 20); libc.memset(big, 1, 8 << 20); libc.free(big)
    base = rss_kib()
    blocks, pins = [], []
    for _ in range(1000):
      p = libc.malloc(96 << 10); libc.memset(p, 1, 96 << 10); blocks.append(p)
      pins.append(libc.malloc(2048))  # above the tcache sizes: from the heap top
    for p in blocks:
      libc.free(p)
    print(rss_kib() - base)
""")


def _retained_mib(apply: bool) -> float:
  out = subprocess.run([sys.executable, "-c", _PROBE, "1" if apply else "0"], check=True,
                       capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(
                           os.path.abspath(__file__))))
  return int(out.stdout.strip().splitlines()[-1]) / 1024


class ReturnFreedMemoryTest(absltest.TestCase):

  def test_freed_buffers_leave_the_process(self):
    if not sys.platform.startswith("linux"):
      self.skipTest("glibc (Linux) only")
    without = _retained_mib(False)
    if without < 50:
      self.skipTest(f"this libc returned the memory by itself ({without:.0f} MiB kept of ~94)")
    self.assertLess(_retained_mib(True), 0.2 * without)

  def test_bad_thresholds_are_refused(self):
    for kw in (dict(mmap_threshold=0), dict(mmap_threshold=1 << 30), dict(mmap_threshold=True),
               dict(mmap_threshold=65536.0), dict(trim_threshold=-1)):
      with self.subTest(**kw), self.assertRaisesRegex(InvalidArgument, "threshold"):
        host_memory.return_freed_memory(**kw)


if __name__ == "__main__":
  absltest.main()

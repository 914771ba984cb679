"""Pallas kernels of paged_kv: segment-table attention and in-place block copies.

Modules (each: kernel, public wrapper with keyword-only static args, `ref_*`):
  pallas_kernels.decode_attention    decode attention over segment tables
  pallas_kernels.prefill_attention  extend/prefill attention with a cached prefix
  pallas_kernels.permute_blocks     in-place block permutation and slot copies
Building for a GPU without one: `pallas_kernels.lowering` (lower for cuda
against an abstract H100/H200); the compile tier (`tests_compile/compile_tier.py`)
compiles on from there for sm_90a with the CUDA PJRT plugin and reads the kernels,
copies, aliasing and ptxas spills of the result.
Functions are not re-exported here, because `decode_attention` and
`permute_blocks` would shadow their own modules. This package imports nothing
from the rest of paged_kv.
"""

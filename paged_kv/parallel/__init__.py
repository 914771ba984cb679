"""Tensor parallel: pools sharded over kv heads and the SPMD model step (`docs/scaling.md`)."""

from paged_kv.parallel.sharding import *  # noqa: F401,F403
from paged_kv.parallel.sharding import __all__  # noqa: F401

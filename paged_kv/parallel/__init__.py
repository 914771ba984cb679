"""Scaling beyond one device: tensor-parallel pools (pages sharded over kv heads).

See `docs/scaling.md`.
"""

from paged_kv.parallel.sharding import *  # noqa: F401,F403
from paged_kv.parallel.sharding import __all__  # noqa: F401

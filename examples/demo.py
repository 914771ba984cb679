"""A short tour of the block pool: allocate, append, fork, release, print metrics.

Usage: python examples/demo.py [--num_blocks=256 --block_size=16]
"""

from absl import app, flags
import jax
import jax.numpy as jnp

import paged_kv
from paged_kv.runtime import compile_cache
from paged_kv.telemetry import metrics

_NUM_BLOCKS = flags.DEFINE_integer("num_blocks", 256, "Blocks in the pool.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "Tokens per block.")
_COMPILE_CACHE = flags.DEFINE_bool("compile_cache", True, "Use JAX's persistent compilation "
                                   "cache (restarts skip XLA compiles).")
_COMPILE_CACHE_DIR = flags.DEFINE_string("compile_cache_dir", None, "The cache's directory "
                                         "(default: $PAGED_KV_COMPILE_CACHE, else "
                                         "~/.cache/paged_kv/jax).")


def _show(title: str, pool: paged_kv.BlockPool) -> None:
  snap = metrics.snapshot(pool.state, pool.config)
  print(f"{title:<34} free={snap.num_free_blocks:4d}  util={snap.block_pool_utilization:6.1%}  "
        f"internal_frag={snap.internal_fragmentation:6.1%}  "
        f"frag_ratio={snap.fragmentation_ratio:5.2f}  seqs={snap.live_sequences}  "
        f"segs/seq={snap.segments_per_sequence:4.1f}  ghost_bytes={snap.ghost_block_bytes}")


def main(argv):
  del argv
  if _COMPILE_CACHE.value:
    compile_cache.enable_compilation_cache(_COMPILE_CACHE_DIR.value)
  config = paged_kv.PoolConfig(num_blocks=_NUM_BLOCKS.value, block_size=_BLOCK_SIZE.value,
                               num_layers=2, num_kv_heads=2, head_dim=32, max_seqs=16)
  pool = paged_kv.BlockPool(config)
  key = jax.random.key(0)
  _show("empty pool", pool)
  seqs = [pool.open_sequence() for _ in range(4)]
  prompt = [37, 5, 130, 16]
  slots = pool.reserve_tokens(seqs, prompt)
  for layer in range(config.num_layers):
    key, sub = jax.random.split(key)
    kv = jax.random.normal(sub, slots.shape + (config.num_kv_heads, config.head_dim))
    pool.write_kv(layer, slots, kv, -kv, seq_ids=seqs)  # slot -1 (padding) is skipped
  _show(f"4 prompts of {prompt} tokens", pool)
  for _ in range(8):
    pool.reserve_tokens(seqs, [1] * len(seqs))
  _show("8 decode steps", pool)
  children = [pool.fork(seqs[0]) for _ in range(3)]
  _show("3 forks of sequence 0", pool)
  pool.reserve_tokens(children, [1, 1, 1])
  _show("children append (new tails)", pool)
  pool.check_invariants()
  try:
    pool.reserve_tokens([seqs[1]], [config.num_slots])
  except paged_kv.PoolExhausted as e:
    print(f"refused as expected: {e}")
  pool.release(seqs + children)
  pool.check_invariants()
  _show("all released", pool)


if __name__ == "__main__":
  app.run(main)

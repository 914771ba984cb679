"""Persistent prefix cache: round trips into pools of other sizes, and damaged files.

A cache is built with the real `BlockPool` and `PrefixCache` (requests matched,
extended with random K/V, inserted, released: shared prefixes, splits inside a
segment, a single-child interior node, two namespaces, a pin), saved, and loaded into a
fresh pool of another size and block size. Every node's path must match the same
tokens and the K/V gathered through the matched segments must be bit-identical.
Each damaged or unfit file must raise its typed error with pool and cache unchanged.
"""

import collections
import dataclasses
import json
import os
import struct
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
import pytest

import paged_kv
from paged_kv.cache import persist
from radix.cache import PrefixCache

_GEOMETRY = dict(num_layers=2, num_kv_heads=2, head_dim=4)
# One source config per dtype, shared by the tests, so jitted transitions compile once.
_SRC = dict(num_blocks=64, block_size=8, max_seqs=4, max_segments=32, **_GEOMETRY)


def _bits(x) -> np.ndarray:
  a = np.asarray(jax.device_get(x))
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _requests(rng: np.random.Generator) -> list[tuple[object, np.ndarray]]:
  """Prompts with shared prefixes, in a str and an int namespace."""
  system = rng.integers(0, 1000, 13)
  out = []
  for ns in ("tenant-a", 7):
    out.append((ns, system))                                         # becomes an interior node
    for _ in range(4):
      out.append((ns, np.concatenate([system, rng.integers(0, 1000, rng.integers(1, 20))])))
    doc = np.concatenate([system, rng.integers(0, 1000, 9)])
    out.append((ns, doc))
    out.append((ns, np.concatenate([doc[:17], rng.integers(1000, 2000, 6)])))  # cut mid-block
  return out


def build_cache(config: paged_kv.PoolConfig, seed: int):
  """A pool and a prefix cache filled by running `_requests` through them."""
  rng = np.random.default_rng(seed)
  pool = paged_kv.BlockPool(config)
  clock = [0.0]
  cache = PrefixCache(block_size=config.block_size, clock=lambda: clock[0])
  for i, (ns, tokens) in enumerate(_requests(rng)):
    clock[0] = float(i)
    m = cache.match(ns, tokens[:-1], lock=False)
    seq = pool.open_sequence(m.segments)
    # One token per call: every call has the same shapes, so each compiles once.
    for _ in range(tokens.shape[0] - m.length):
      slot = pool.reserve_tokens([seq], [1])
      for layer in range(config.num_layers):
        shape = (1, 1, config.num_kv_heads, config.head_dim)
        k = rng.standard_normal(shape).astype(config.jnp_dtype)
        v = rng.standard_normal(shape).astype(config.jnp_dtype)
        pool.write_kv(layer, slot, k, v, seq_ids=seq)
    outcome = cache.insert(ns, tokens, pool.segments(seq),
                           pin_ttl=100.0 if i == 0 else None)
    if len(outcome.ref_deltas):
      pool.apply_ref_deltas(outcome.ref_deltas.block_ids, outcome.ref_deltas.deltas)
    pool.release([seq])
  pool.check_invariants(extra_segments=cache.segment_refs())
  return pool, cache


def cached_paths(cache: PrefixCache) -> dict:
  """(namespace, path tokens) of every node -> node."""
  return {(n.namespace, tuple(cache.tree.path_tokens(n.node_id).tolist())): n
          for n in cache.tree.nodes()}


def gather_prefix(pool: paged_kv.BlockPool, cache: PrefixCache, ns, tokens):
  """Matched length and the K/V bits of the matched segments, read from the pages."""
  m = cache.match(ns, np.asarray(tokens), lock=False, record=False)
  bs = pool.config.block_size
  slots = np.concatenate([np.arange(b * bs + s, b * bs + s + l) for b, s, l in m.segments])
  def take(pages):
    l, h, n, _, d = pages.shape
    return _bits(pages).reshape(l, h, n * bs, d)[:, :, slots]
  return m.length, take(pool.state.pages.k), take(pool.state.pages.v)


def _in_base(pool: paged_kv.BlockPool) -> int:
  """Referenced blocks in the base region."""
  meta = pool.state.meta
  return int(((np.asarray(meta.region) == 1) & (np.asarray(meta.ref_count) > 0)).sum())


def _tempdir(test: absltest.TestCase) -> str:
  """A directory removed after the test (works under pytest and absltest alike)."""
  tmp = tempfile.TemporaryDirectory()
  test.addCleanup(tmp.cleanup)
  return tmp.name


def snapshot(pool: paged_kv.BlockPool) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(pool.state)]


class RoundTripTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # Another pool size, block size, max_seqs and max_segments.
      ("f32_other_pool", "float32", dict(num_blocks=96, block_size=4, max_seqs=2,
                                         max_segments=48)),
      # A fresh pool of the saving pool's config (a new config would cost compile time).
      ("bf16_same_config", "bfloat16", {}),
  )
  def test_round_trip_is_bit_exact(self, dtype, dst_change):
    src = paged_kv.PoolConfig(dtype=dtype, **_SRC)
    pool, cache = build_cache(src, seed=1)
    path = os.path.join(_tempdir(self), "cache.pkv")
    persist.save_prefix_cache(path, pool, cache)

    dst = paged_kv.PoolConfig(dtype=dtype, **{**_SRC, **dst_change})
    dst_block_size = dst.block_size
    new_pool = paged_kv.BlockPool(dst)
    clock = [1000.0]
    loaded = persist.load_prefix_cache(
        path, new_pool, PrefixCache(block_size=dst_block_size, clock=lambda: clock[0]))
    new_pool.check_invariants(extra_segments=loaded.segment_refs())

    old_nodes, new_nodes = cached_paths(cache), cached_paths(loaded)
    self.assertEqual(set(old_nodes), set(new_nodes))
    self.assertLen(new_nodes, len(cache.tree))
    for (ns, tokens), node in old_nodes.items():
      length, k, v = gather_prefix(pool, cache, ns, tokens)
      new_length, new_k, new_v = gather_prefix(new_pool, loaded, ns, tokens)
      self.assertEqual((length, new_length), (len(tokens), len(tokens)))
      np.testing.assert_array_equal(k, new_k)
      np.testing.assert_array_equal(v, new_v)
      # Pins survive as remaining TTL; the loaded clock differs from the saved one.
      self.assertEqual(node.is_pinned(cache._now()),
                       new_nodes[(ns, tokens)].is_pinned(clock[0]))
    self.assertTrue(any(n.is_pinned(clock[0]) for n in loaded.tree.nodes()))
    # LRU order of the leaves is preserved.
    lru = lambda c: [(n.namespace, tuple(c.tree.path_tokens(n.node_id).tolist()))
                     for n in sorted(c.tree.leaves(), key=lambda n: (n.last_access,
                                                                     n.access_seq))]
    self.assertEqual(lru(cache), lru(loaded))
    # Compacted on load: the cache occupies exactly the lowest blocks, each node has
    # the minimum number of segments.
    used = np.flatnonzero(np.asarray(new_pool.state.meta.ref_count))
    np.testing.assert_array_equal(used, np.arange(used.size))
    self.assertLessEqual(used.size, -(-loaded.num_tokens // dst_block_size)
                         + len(loaded.tree))
    for n in loaded.tree.nodes():
      self.assertLen(n.value, -(-n.num_tokens // dst_block_size))

  def test_promoted_blocks_restore_into_a_pool_of_the_same_config(self):
    """A cache with promoted blocks in the base region, the dynamic region full too, restores into a fresh pool of the same config (a restart): loaded
    blocks move into the base region as the dynamic one fills. Before: PoolExhausted."""
    from paged_kv.cache.cached_pool import CachedPool  # pylint: disable=g-import-not-at-top
    cfg = paged_kv.PoolConfig(num_blocks=32, block_size=4, num_layers=1, num_kv_heads=1,
                              head_dim=2, max_seqs=4, max_segments=32, base_pool_fraction=0.25)
    cp = CachedPool(paged_kv.BlockPool(cfg))
    rng = np.random.default_rng(0)

    def cache_sequence(tokens):
      sid = cp.open()
      slots = np.asarray(cp.pool.reserve_tokens([sid], [len(tokens)]))[0, :len(tokens)]
      kv = jnp.asarray(rng.standard_normal((1, 1, len(tokens), 2)), jnp.float32)
      cp.pool.write_kv_layers(slots, kv, kv * 2, seq_ids=sid)
      cp.insert("ns", np.asarray(tokens, np.int32), sid, release=True)

    cache_sequence(np.arange(16))
    cp.promote(min_readers=1, max_moves=4)  # its 4 blocks into the base region
    t = 1000
    while cp.pool.num_free_blocks >= 4:
      cache_sequence(np.arange(t, t + 16))
      t += 16
    self.assertGreater(_in_base(cp.pool), 0)
    path = os.path.join(_tempdir(self), "c.pkv")
    cp.save(path)
    fresh = CachedPool(paged_kv.BlockPool(cfg))
    fresh.restore(path)
    fresh.check_invariants()
    old_nodes, new_nodes = cached_paths(cp.cache), cached_paths(fresh.cache)
    self.assertEqual(set(old_nodes), set(new_nodes))
    for ns, tokens in old_nodes:
      length, k, v = gather_prefix(cp.pool, cp.cache, ns, tokens)
      new_length, new_k, new_v = gather_prefix(fresh.pool, fresh.cache, ns, tokens)
      self.assertEqual(length, new_length)
      np.testing.assert_array_equal(k, new_k)
      np.testing.assert_array_equal(v, new_v)
    self.assertGreater(_in_base(fresh.pool), 0)  # it needed the base region

  def test_default_cache_and_empty_cache(self):
    config = paged_kv.PoolConfig(**_SRC)
    pool, cache = build_cache(config, seed=2)
    tmp = _tempdir(self)
    persist.save_prefix_cache(os.path.join(tmp, "full"), pool, cache)
    new_pool = paged_kv.BlockPool(config)
    loaded = persist.load_prefix_cache(os.path.join(tmp, "full"), new_pool)
    new_pool.check_invariants(extra_segments=loaded.segment_refs())
    self.assertEqual(set(cached_paths(cache)), set(cached_paths(loaded)))

    empty_pool = paged_kv.BlockPool(config)
    persist.save_prefix_cache(os.path.join(tmp, "empty"), empty_pool,
                              PrefixCache(block_size=8))
    target = paged_kv.BlockPool(config)
    before = snapshot(target)
    loaded = persist.load_prefix_cache(os.path.join(tmp, "empty"), target)
    self.assertEqual(len(loaded.tree), 0)
    for a, b in zip(before, snapshot(target)):
      np.testing.assert_array_equal(a, b)

  def test_every_typed_namespace_round_trips(self):
    config = paged_kv.PoolConfig(**_SRC)
    pool = paged_kv.BlockPool(config)
    cache = PrefixCache(block_size=8)
    namespaces = ["t", 1, b"\x00\xff", ("tenant", 1), ("a", (b"b", 2)), (), "1"]
    for i, ns in enumerate(namespaces):
      seq = pool.open_sequence()
      pool.reserve_tokens([seq], [3])
      outcome = cache.insert(ns, [i, i + 1, i + 2], pool.segments(seq))
      pool.apply_ref_deltas(outcome.ref_deltas.block_ids, outcome.ref_deltas.deltas)
      pool.release([seq])
    path = os.path.join(_tempdir(self), "typed")
    persist.save_prefix_cache(path, pool, cache)
    target = paged_kv.BlockPool(config)
    loaded = persist.load_prefix_cache(path, target)
    got = sorted((repr(n.namespace), type(n.namespace).__name__) for n in loaded.tree.nodes())
    want = sorted((repr(ns), type(ns).__name__) for ns in namespaces)
    self.assertEqual(got, want)
    for i, ns in enumerate(namespaces):
      self.assertEqual(loaded.match(ns, [i, i + 1, i + 2]).length, 3, ns)
    self.assertEqual(loaded.match(1, [1, 2, 3]).length, 3)
    self.assertEqual(loaded.match("1", [1, 2, 3]).length, 0)  # "1" holds [6, 7, 8], not 1's
    target.check_invariants(extra_segments=loaded.segment_refs())

  def test_untyped_namespace_is_refused_and_bad_entries_are_corrupt(self):
    for ns in (1.5, True, np.int64(1), ("a", 1.0), ["t"]):
      with self.assertRaises(persist.UnsupportedNamespaceError):
        persist._encode_namespace(ns)  # pylint: disable=protected-access
    for entry in ({"type": "bytes", "value": "zz"}, {"type": "int", "value": True},
                  {"type": "tuple", "value": "ab"}, {"type": "float", "value": 1.0},
                  {"type": "str", "value": 3}, "t"):
      with self.assertRaises(persist.CorruptFileError):
        persist._decode_namespace(entry)  # pylint: disable=protected-access
    deep = {"type": "str", "value": "x"}
    for _ in range(100):
      deep = {"type": "tuple", "value": [deep]}
    with self.assertRaises(persist.CorruptFileError):
      persist._decode_namespace(deep)  # pylint: disable=protected-access


class DamagedFileTest(absltest.TestCase):
  """Every failure: a typed error, and the pool and the given cache are unchanged."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.config = paged_kv.PoolConfig(**_SRC)
    pool, cache = build_cache(cls.config, seed=3)
    cls._tmp = tempfile.TemporaryDirectory()
    cls.tmp = cls._tmp.name
    cls.path = os.path.join(cls.tmp, "good.pkv")
    persist.save_prefix_cache(cls.path, pool, cache)
    with open(cls.path, "rb") as f:
      cls.raw = f.read()

  @classmethod
  def tearDownClass(cls):
    cls._tmp.cleanup()
    super().tearDownClass()

  def write(self, name: str, data: bytes) -> str:
    path = os.path.join(self.tmp, name)
    with open(path, "wb") as f:
      f.write(data)
    return path

  def rewrite(self, name: str, edit) -> str:
    """A well-formed archive whose members were changed by `edit(header, arrays)`."""
    with np.load(self.path, allow_pickle=False) as z:
      arrays = {n: z[n] for n in z.files}
    header = json.loads(arrays.pop("header").tobytes())
    edit(header, arrays)
    path = os.path.join(self.tmp, name)
    with open(path, "wb") as f:
      np.savez(f, header=np.frombuffer(json.dumps(header).encode(), np.uint8), **arrays)
    return path

  def assert_refused(self, path: str, error: type, regex: str, config=None):
    pool = paged_kv.BlockPool(config or self.config)
    c = pool.config
    if config is None:  # something live, so "unchanged" means something
      seq = pool.open_sequence()
      slots = pool.reserve_tokens([seq], [5])[:, :5]
      kv = np.ones((1, 5, c.num_kv_heads, c.head_dim), c.jnp_dtype)
      pool.write_kv(0, slots, kv, kv, seq_ids=seq)
    before = snapshot(pool)
    cache = PrefixCache(block_size=c.block_size)
    with self.assertRaisesRegex(error, regex):
      persist.load_prefix_cache(path, pool, cache)
    for a, b in zip(before, snapshot(pool)):
      np.testing.assert_array_equal(a, b)
    self.assertEqual(len(cache.tree), 0)
    pool.check_invariants()

  def test_good_file_loads(self):
    pool = paged_kv.BlockPool(self.config)
    cache = persist.load_prefix_cache(self.path, pool)
    pool.check_invariants(extra_segments=cache.segment_refs())

  def test_truncated(self):
    for cut in (0, 100, len(self.raw) // 2, len(self.raw) - 1):
      self.assert_refused(self.write(f"cut{cut}", self.raw[:cut]), persist.CorruptFileError,
                          "truncated or corrupted")

  def test_torn_between_two_saves(self):
    """A file of one save's first bytes and another's last (a torn write, which
    `save`'s rename prevents, made by hand): refused typed, or, where the archive
    still reads whole (the checksum passes), exactly one of the two caches."""
    saves = {}
    for seed in (3, 4):
      pool, cache = build_cache(self.config, seed=seed)
      path = os.path.join(self.tmp, f"seed{seed}.pkv")
      persist.save_prefix_cache(path, pool, cache)
      with open(path, "rb") as f:
        raw = f.read()
      saves[raw] = {key: gather_prefix(pool, cache, key[0], key[1])
                    for key in cached_paths(cache)}
    (raw_a, want_a), (raw_b, want_b) = saves.items()
    n = min(len(raw_a), len(raw_b))
    refused = loaded = 0
    for cut in sorted({1, 64, n // 4, n // 2, 3 * n // 4, n - 64, n - 8}):
      for name, data in ((f"torn-ab{cut}", raw_a[:cut] + raw_b[cut:]),
                         (f"torn-ba{cut}", raw_b[:cut] + raw_a[cut:])):
        pool = paged_kv.BlockPool(self.config)
        cache = PrefixCache(block_size=self.config.block_size)
        try:
          persist.load_prefix_cache(self.write(name, data), pool, cache)
        except persist.CorruptFileError:
          refused += 1
          self.assertEqual(len(cache.tree), 0)
          continue
        got = {key: gather_prefix(pool, cache, key[0], key[1]) for key in cached_paths(cache)}
        want = want_a if got.keys() == want_a.keys() else want_b
        self.assertEqual(got.keys(), want.keys(), name)
        for key, (length, k, v) in want.items():
          self.assertEqual(got[key][0], length, name)
          np.testing.assert_array_equal(got[key][1], k, name)
          np.testing.assert_array_equal(got[key][2], v, name)
        loaded += 1
    self.assertGreater(refused, 0)

  def test_flipped_byte(self):
    for pos in (len(self.raw) // 3, len(self.raw) // 2, len(self.raw) - 30):
      data = bytearray(self.raw)
      data[pos] ^= 0x40
      self.assert_refused(self.write(f"flip{pos}", bytes(data)), persist.CorruptFileError, "")

  def test_checksum_mismatch_in_consistent_archive(self):
    def edit(header, arrays):
      arrays["k"] = arrays["k"].copy()
      arrays["k"].flat[7] ^= 1
    self.assert_refused(self.rewrite("sha", edit), persist.CorruptFileError, "checksum")

    def edit_tokens(header, arrays):
      arrays["tokens"] = arrays["tokens"] + 1
    self.assert_refused(self.rewrite("tok", edit_tokens), persist.CorruptFileError,
                        "checksum")

  def test_missing_member(self):
    self.assert_refused(self.rewrite("miss", lambda h, a: a.pop("node_pin_ttl")),
                        persist.CorruptFileError, "missing members")

  def test_wrong_version(self):
    def edit(header, arrays):
      header["version"] = 2
    self.assert_refused(self.rewrite("v2", edit), persist.UnsupportedVersionError,
                        "version 2")

    def edit_format(header, arrays):
      header["format"] = "something.else"
    self.assert_refused(self.rewrite("fmt", edit_format), persist.UnsupportedVersionError,
                        "format")

  def test_mismatched_config(self):
    for change, word in ((dict(num_layers=3), "num_layers"),
                         (dict(num_kv_heads=1), "num_kv_heads"),
                         (dict(head_dim=8), "head_dim"),
                         (dict(dtype="bfloat16"), "dtype")):
      self.assert_refused(self.path, persist.ConfigMismatchError, word,
                          config=paged_kv.PoolConfig(**{**_SRC, **change}))

  def test_pool_too_small(self):
    config = paged_kv.PoolConfig(**{**_SRC, "num_blocks": 8})
    self.assert_refused(self.path, paged_kv.PoolExhausted, "no_free_block", config=config)

  def test_failure_half_way_rolls_back_references(self):
    """An unexpected error while writing (after validation) leaves no block allocated."""
    pool = paged_kv.BlockPool(self.config)
    meta_before = [np.asarray(x) for x in (pool.state.meta.ref_count, pool.state.meta.slots,
                                           pool.state.meta.free_list)]
    write_kv, calls = pool.write_kv_layers, []
    def failing_write_kv(*args, **kwargs):
      calls.append(1)
      if len(calls) > 1:  # the second batch of the load (one write per batch)
        raise RuntimeError("device lost")
      write_kv(*args, **kwargs)
    pool.write_kv_layers = failing_write_kv
    cache = PrefixCache(block_size=8)
    with self.assertRaisesRegex(RuntimeError, "device lost"):
      persist.load_prefix_cache(self.path, pool, cache)
    self.assertGreater(len(calls), 1)  # it did fail half-way
    meta_after = [np.asarray(x) for x in (pool.state.meta.ref_count, pool.state.meta.slots,
                                          pool.state.meta.free_list)]
    for a, b in zip(meta_before, meta_after):
      np.testing.assert_array_equal(a, b)
    self.assertEqual(len(pool.active_sequences()), 0)
    self.assertEqual(len(cache.tree), 0)
    pool.check_invariants()

  def test_non_empty_cache_refused(self):
    pool = paged_kv.BlockPool(self.config)
    cache = PrefixCache(block_size=8)
    cache.insert("x", [1], np.zeros((1, 3), np.int32) + [0, 0, 1])
    before = snapshot(pool)
    with self.assertRaisesRegex(paged_kv.InvalidArgument, "empty cache"):
      persist.load_prefix_cache(self.path, pool, cache)
    for a, b in zip(before, snapshot(pool)):
      np.testing.assert_array_equal(a, b)
    self.assertEqual(len(cache.tree), 1)


  def test_directory_and_missing_path_are_typed(self):
    """A directory or a missing file is a typed `PersistError`, the pool untouched."""
    self.assert_refused(self.tmp, persist.UnreadableFileError, "Is a directory")
    missing = os.path.join(self.tmp, "no-such-file")
    self.assert_refused(missing, persist.MissingFileError, "no prefix-cache file")
    with self.assertRaises(FileNotFoundError):  # still one, for callers that catch it
      persist.load_prefix_cache(missing, paged_kv.BlockPool(self.config))
    self.assert_refused(123, paged_kv.InvalidArgument, "path")

  def test_zip_directory_flags_are_typed(self):
    """The flips a probe found untyped: "encrypted" and unknown-compression members."""
    cd_offset, cd_size = _central_directory(self.raw)
    entry = cd_offset  # first central-directory entry: flags at +8, method at +10
    for name, pos, mask, word in (("encrypted", entry + 8, 0x01, "encrypted"),
                                  ("method", entry + 10, 0x02, "compression method"),
                                  ("strong", entry + 8, 0x40, "")):
      data = bytearray(self.raw)
      data[pos] ^= mask
      self.assert_refused(self.write(f"cd-{name}", bytes(data)), persist.CorruptFileError,
                          word)
    self.assertGreater(cd_size, 0)

  def test_save_over_a_directory_is_typed(self):
    pool = paged_kv.BlockPool(self.config)
    target = os.path.join(self.tmp, "a-directory")
    os.makedirs(target, exist_ok=True)
    with self.assertRaises(persist.UnwritableFileError):
      persist.save_prefix_cache(target, pool, PrefixCache(block_size=8))
    self.assertEqual(os.listdir(target), [])
    self.assertFalse([n for n in os.listdir(self.tmp) if ".tmp-" in n])


def _central_directory(raw: bytes) -> tuple[int, int]:
  """`(offset, size)` of a zip's central directory, from its end record (no comment)."""
  eocd = raw.rfind(b"PK\x05\x06")
  size, offset = struct.unpack("<II", raw[eocd + 12:eocd + 20])
  return offset, size


# Full sweep of every bit (about 22k loads, a few minutes): PAGED_KV_BITFLIP_FULL=1.
_FULL_LOADS = 32  # harmless flips loaded into a pool in CI (all in the full sweep)
_FULL_SWEEP = bool(int(os.environ.get("PAGED_KV_BITFLIP_FULL", "0") or 0))
_TINY = paged_kv.PoolConfig(num_blocks=8, block_size=4, num_layers=1, num_kv_heads=1,
                            head_dim=2, max_seqs=2, max_segments=4)


# A child process saves cache A (seed 3) to a path, then cache B (seed 4) over it and
# is killed (`os._exit`, no cleanup) after writing `offset` bytes of B's temporary file,
# or, with `offset` -1, after the whole file but before the rename.
_CRASH_CHILD = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import paged_kv
from paged_kv.cache import persist
from tests.cache.test_persist import _SRC, build_cache
path, offset = sys.argv[2], int(sys.argv[3])
config = paged_kv.PoolConfig(**_SRC)
pool_a, cache_a = build_cache(config, seed=3)
persist.save_prefix_cache(path, pool_a, cache_a)
pool_b, cache_b = build_cache(config, seed=4)
class Killing:
  def __init__(self, f):
    self.f, self.n = f, 0
  def write(self, b):
    b = bytes(b)
    if 0 <= offset < self.n + len(b):
      self.f.write(b[:offset - self.n]); self.f.flush()
      os._exit(137)  # a kill mid-write: no finally, no cleanup
    self.n += len(b)
    return self.f.write(b)
  def __getattr__(self, name):
    return getattr(self.f, name)
  def __enter__(self):
    return self
  def __exit__(self, *exc):
    return self.f.__exit__(*exc)
persist.open = lambda name, mode="r", *a, **k: Killing(open(name, mode, *a, **k))
if offset == -1:
  def kill_before_rename(src, dst):
    os._exit(137)
  persist.os.replace = kill_before_rename
persist.save_prefix_cache(path, pool_b, cache_b)
print("completed")
"""


@pytest.mark.slow
class CrashMidSaveTest(absltest.TestCase):
  """A save killed at any byte leaves the previous file, whole: it loads bit-exact
  (or, once the rename happened, the new one does). `PAGED_KV_CRASH_OFFSETS=N` kills
  at N random offsets (the long run); CI kills at 3 and just before the rename."""

  def test_a_killed_save_leaves_the_previous_file(self):
    import subprocess  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = paged_kv.PoolConfig(**_SRC)
    tmp = _tempdir(self)
    want, size = {}, {}  # which cache a file holds -> its paths' K/V; its file's bytes
    for name, seed in (("a", 3), ("b", 4)):
      pool, cache = build_cache(config, seed=seed)
      path = os.path.join(tmp, f"{name}.pkv")
      persist.save_prefix_cache(path, pool, cache)
      want[name] = {key: gather_prefix(pool, cache, key[0], key[1]) for key in cached_paths(cache)}
      size[name] = os.path.getsize(path)
    size_b = size["b"]
    rng = np.random.default_rng(0)
    n = int(os.environ.get("PAGED_KV_CRASH_OFFSETS", "0") or 0)
    offsets = ([-1] + sorted(int(x) for x in rng.integers(0, size_b, n)) if n else
               [-1, 0, size_b // 2, size_b - 1])
    seen = collections.Counter()
    for offset in offsets:
      path = os.path.join(tmp, f"crash-{offset}.pkv")
      out = subprocess.run([sys.executable, "-c", _CRASH_CHILD, repo, path, str(offset)],
                           capture_output=True, text=True, cwd=repo, timeout=300)
      self.assertEqual(out.returncode, 137, f"offset {offset}: {out.stderr[-2000:]}")
      self.assertTrue(os.path.exists(path), offset)
      pool = paged_kv.BlockPool(config)
      cache = PrefixCache(block_size=config.block_size)
      persist.load_prefix_cache(path, pool, cache)  # never a torn file under `path`
      got = {key: gather_prefix(pool, cache, key[0], key[1]) for key in cached_paths(cache)}
      which = [name for name, w in want.items() if w.keys() == got.keys()]
      self.assertEqual(which, ["a"], offset)  # killed before the rename: the old file
      for key, (length, k, v) in want["a"].items():
        self.assertEqual(got[key][0], length)
        np.testing.assert_array_equal(got[key][1], k)
        np.testing.assert_array_equal(got[key][2], v)
      seen[which[0]] += 1
      leftovers = [f for f in os.listdir(tmp) if f.startswith(f"crash-{offset}.pkv.tmp")]
      self.assertEqual(leftovers, [])  # the load removed the killed save's temporary file
    self.assertEqual(seen["a"], len(offsets))


class StaleTempTest(absltest.TestCase):
  """Saves and loads remove the temporary files of dead writers of their path, and only
  those: writers are killed with SIGKILL holding `<path>.tmp-<pid>` open."""

  def _writer(self, path: str):
    """A process that creates its temporary file of `path`, then waits to be killed."""
    import subprocess  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top
    code = ("import os, sys, time\n"
            "f = open(sys.argv[1] + '.tmp-' + str(os.getpid()), 'wb'); f.write(b'PK' * 64)\n"
            "f.flush(); print('ready', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE)
    self.addCleanup(lambda: (proc.poll() is None and proc.kill(), proc.wait()))
    self.assertEqual(proc.stdout.readline().strip(), b"ready")
    return proc

  def test_killed_writers_leave_nothing_after_a_save_and_a_load(self):
    tmp = _tempdir(self)
    path = os.path.join(tmp, "cache.pkv")
    other = os.path.join(tmp, "other.pkv")
    writers = [self._writer(path) for _ in range(4)]
    live = self._writer(path)  # still saving: its file stays
    foreign = self._writer(other)  # another path's writer, dead: not this path's business
    for proc in (*writers, foreign):
      proc.kill()
      proc.wait()
    count = lambda name: sum(f.startswith(name + ".tmp-") for f in os.listdir(tmp))
    self.assertEqual(count("cache.pkv"), 5)
    pool = paged_kv.BlockPool(_TINY)
    cache = PrefixCache(block_size=_TINY.block_size)
    persist.save_prefix_cache(path, pool, cache)
    self.assertEqual(count("cache.pkv"), 1)  # the live writer's
    self.assertEqual(count("other.pkv"), 1)
    # A file older than the bound is stale whoever holds its pid (a reused pid).
    live_tmp = f"{path}.tmp-{live.pid}"
    os.utime(live_tmp, (0, 0))
    persist.load_prefix_cache(path, paged_kv.BlockPool(_TINY))
    self.assertEqual(count("cache.pkv"), 0)
    self.assertEqual(sorted(os.listdir(tmp)), ["cache.pkv", f"other.pkv.tmp-{foreign.pid}"])
    self.assertEqual(persist.remove_stale_temps(other), [f"{other}.tmp-{foreign.pid}"])


@pytest.mark.slow
class BitFlipSweepTest(absltest.TestCase):
  """Every single-bit flip of a small saved file: a typed error with the pool unchanged,
  or (a flip in a field the reader ignores, e.g. a zip timestamp) a bit-exact load.

  CI flips every bit of the zip central directory and end record plus every 16th bit
  of the rest (from a rotating offset); `PAGED_KV_BITFLIP_FULL=1` flips every bit.
  A harmless flip must read back exactly the good file's content; the first
  `_FULL_LOADS` of them (all, in the full sweep) are also loaded into a fresh pool
  and read back bit-exact through the loaded cache's segments.
  """

  def test_every_flip_is_typed_or_harmless(self):
    pool = paged_kv.BlockPool(_TINY)
    cache = PrefixCache(block_size=_TINY.block_size)
    for ns, tokens in (("a", [1, 2, 3, 4, 5, 6]), (7, [1, 2, 9])):
      seq = pool.open_sequence()
      slot_idx = pool.reserve_tokens([seq], [len(tokens)])
      kv = (np.arange(slot_idx.size * 2, dtype=np.float32).reshape(slot_idx.shape + (1, 2))
            + 100 * len(tokens))
      pool.write_kv(0, slot_idx, kv, -kv, seq_ids=seq)
      pool.apply_ref_deltas(*_deltas(cache.insert(ns, tokens, pool.segments(seq))))
      pool.release([seq])
    tmp = _tempdir(self)
    good = os.path.join(tmp, "good")
    persist.save_prefix_cache(good, pool, cache)
    with open(good, "rb") as f:
      raw = f.read()
    expected = {key: gather_prefix(pool, cache, key[0], key[1])
                for key in cached_paths(cache)}

    target = paged_kv.BlockPool(_TINY)  # something live, so "unchanged" means something
    seq = target.open_sequence()
    target.write_kv(0, target.reserve_tokens([seq], [3]), np.ones((1, 4, 1, 2), np.float32),
                    np.ones((1, 4, 1, 2), np.float32), seq_ids=seq)
    before = snapshot(target)
    good_saved = persist._read(good)  # pylint: disable=protected-access

    cd_offset, _ = _central_directory(raw)
    bits = np.arange(len(raw) * 8)
    if not _FULL_SWEEP:
      rest = bits[(bits < cd_offset * 8) & (bits % 16 == (bits // 16) % 16)]
      bits = np.concatenate([rest, bits[bits >= cd_offset * 8]])
    outcomes = collections.Counter()
    flipped = os.path.join(tmp, "flipped")
    for bit in bits.tolist():
      data = bytearray(raw)
      data[bit // 8] ^= 1 << (bit % 8)
      with open(flipped, "wb") as f:
        f.write(data)
      loaded_cache = PrefixCache(block_size=_TINY.block_size)
      try:
        saved = persist._read(flipped)  # pylint: disable=protected-access
      except persist.PersistError as e:
        outcomes[type(e).__name__] += 1
        # The same refusal leaves a pool with live data unchanged.
        with self.assertRaises(type(e)):
          persist.load_prefix_cache(flipped, target, PrefixCache(block_size=_TINY.block_size))
        self.assertEqual(len(loaded_cache.tree), 0)
        continue
      except Exception as e:  # pylint: disable=broad-except
        self.fail(f"bit {bit} (byte {bit // 8}): untyped {type(e).__name__}: {e}")
      outcomes["loaded"] += 1
      for field in dataclasses.fields(saved):
        got, want = getattr(saved, field.name), getattr(good_saved, field.name)
        if isinstance(want, np.ndarray):
          np.testing.assert_array_equal(got, want, f"bit {bit}: {field.name}")
          self.assertEqual(got.dtype, want.dtype, f"bit {bit}: {field.name}")
        else:
          self.assertEqual(got, want, f"bit {bit}: {field.name}")
      if outcomes["loaded"] > _FULL_LOADS and not _FULL_SWEEP:
        continue
      fresh = paged_kv.BlockPool(_TINY)
      persist.load_prefix_cache(flipped, fresh, loaded_cache)
      self.assertEqual(set(cached_paths(loaded_cache)), set(expected), f"bit {bit}")
      for key, (length, k, v) in expected.items():
        new_length, new_k, new_v = gather_prefix(fresh, loaded_cache, key[0], key[1])
        self.assertEqual(new_length, length, f"bit {bit}")
        np.testing.assert_array_equal(new_k, k, f"bit {bit}")
        np.testing.assert_array_equal(new_v, v, f"bit {bit}")
    for a, b in zip(before, snapshot(target)):
      np.testing.assert_array_equal(a, b)
    target.check_invariants()
    print(f"bit flips: {len(bits)} of {len(raw) * 8} bits ({len(raw)} bytes): "
          f"{dict(outcomes)}")
    self.assertEqual(sum(outcomes.values()), len(bits))
    self.assertGreater(outcomes["CorruptFileError"], 0)


def _deltas(outcome):
  return outcome.ref_deltas.block_ids, outcome.ref_deltas.deltas


if __name__ == "__main__":
  absltest.main()

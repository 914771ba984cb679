"""The radix cache under adversarial use: typed namespaces, split-on-lock matches,
countable eviction targets, lock reset and clear (recovery after an interrupted caller)."""

import numpy as np
from absl.testing import absltest

from radix.cache import PrefixCache, RefDeltas
from radix.tree import InvalidNamespaceError, RadixTree, check_namespace

BS = 4


def _segs(first_block, num_tokens):
  rows, b, left = [], first_block, num_tokens
  while left:
    n = min(BS, left)
    rows.append([b, 0, n])
    b, left = b + 1, left - n
  return np.array(rows, np.int32)


class NamespaceTest(absltest.TestCase):

  def test_typed_keys_only(self):
    for ns in ("t", b"t", 0, 7, ("adapter", 7), ("a", (b"x", 1))):
      self.assertEqual(check_namespace(ns), ns)
    for ns in (1.0, True, np.int64(1), np.str_("t"), None, ["t"], ("a", False), frozenset()):
      with self.assertRaises(InvalidNamespaceError, msg=repr(ns)):
        check_namespace(ns)

  def test_cross_type_equal_values_never_share(self):
    """FIXED item 9: `1`, `1.0`, `True`, `np.int64(1)` were one namespace."""
    cache = PrefixCache(block_size=BS)
    cache.insert(1, np.arange(8), _segs(0, 8))
    for ns in (1.0, True, np.int64(1)):
      with self.assertRaises(InvalidNamespaceError):
        cache.match(ns, np.arange(8), lock=False)
      with self.assertRaises(InvalidNamespaceError):
        cache.insert(ns, np.arange(8), _segs(2, 8))
    self.assertEqual(cache.match(1, np.arange(8), lock=False).length, 8)
    self.assertEqual(cache.match("1", np.arange(8), lock=False).length, 0)
    self.assertEqual(RadixTree().match_prefix(b"1", [1], now=0.0).length, 0)


class SplitOnLockTest(absltest.TestCase):

  def test_lock_covers_only_the_matched_tokens(self):
    """FIXED item 2: a 1-token match locked the whole 24-token node."""
    cache = PrefixCache(block_size=BS)
    out = cache.insert("t", np.arange(24), _segs(0, 24))
    rc = np.zeros(8, np.int64)
    out.ref_deltas.apply_to(rc)
    m = cache.match("t", np.array([0, 99]), lock=True, split=True)
    self.assertEqual(m.length, 1)
    np.testing.assert_array_equal(m.ref_deltas.block_ids, [0])  # the cut of block 0
    m.ref_deltas.apply_to(rc)
    np.testing.assert_array_equal(rc, cache.tree_ref_counts(8))
    ev = cache.evict(num_tokens=100, ref_count=rc)
    self.assertEqual(ev.num_tokens, 23)  # everything but the locked head
    cache.unlock(m.node)
    # Without split: the old behaviour (the whole node locked, no deltas).
    cache2 = PrefixCache(block_size=BS)
    cache2.insert("t", np.arange(24), _segs(0, 24))
    m2 = cache2.match("t", np.array([0, 99]), lock=True)
    self.assertEqual(len(m2.ref_deltas), 0)
    self.assertEqual(cache2.evict(num_tokens=100).num_tokens, 0)


class CountableEvictionTest(absltest.TestCase):

  def test_only_countable_blocks_count_toward_the_target(self):
    """FIXED item 1: a freed base-region block counted toward `num_blocks`."""
    cache = PrefixCache(block_size=BS)
    cache.insert("t", np.arange(4), _segs(0, 4))          # oldest: block 0 (base)
    cache.insert("t", np.arange(10, 14), _segs(5, 4))     # block 5 (dynamic)
    rc = cache.tree_ref_counts(8)
    countable = np.arange(8) >= 2
    ev = cache.evict(num_blocks=1, ref_count=rc, countable=countable)
    self.assertEqual(ev.num_freed_blocks, 1)
    self.assertEqual(sorted(ev.ref_deltas.block_ids.tolist()), [0, 5])
    with self.assertRaises(ValueError):
      cache.evict(num_blocks=1, ref_count=rc, countable=np.ones(3, bool))


class RecoveryHelpersTest(absltest.TestCase):

  def test_reset_locks_and_clear(self):
    cache = PrefixCache(block_size=BS)
    cache.insert("t", np.arange(8), _segs(0, 8))
    a = cache.match("t", np.arange(8)).node
    cache.match("t", np.arange(8))          # a second lock, then "lost"
    cache.reset_locks([a])
    self.assertEqual(cache.tree.node(a).lock_ref, 1)
    cache.unlock(a)
    self.assertEqual(cache.tree.node(a).lock_ref, 0)
    cache.match("t", np.arange(8))
    deltas = cache.clear()
    self.assertIsInstance(deltas, RefDeltas)
    np.testing.assert_array_equal(deltas.block_ids, [0, 1])
    np.testing.assert_array_equal(deltas.deltas, [-1, -1])
    self.assertEqual((len(cache.tree), cache.num_tokens, cache.num_segments), (0, 0, 0))
    self.assertEqual(cache.match("t", np.arange(8)).length, 0)


if __name__ == "__main__":
  absltest.main()

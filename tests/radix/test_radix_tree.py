"""Tests of radix.tree: the pure radix tree (no JAX, no pool)."""

import subprocess
import sys

import numpy as np
from absl.testing import absltest, parameterized

from radix.tree import (
    HitStats,
    InvalidNamespaceError,
    InvalidTokensError,
    LockError,
    RadixTree,
    StaleNodeError,
    as_tokens,
)


def _seq_split(value, offset):
  """Value = tuple of per-token labels; split like the cache splits segments."""
  return value[:offset], value[offset:]


def _labelled_tree():
  return RadixTree(split_value=_seq_split)


def _insert(tree, ns, tokens, now=0.0):
  tokens = list(tokens)
  return tree.insert(
      ns,
      tokens,
      lambda p: tuple(("v", ns, tuple(tokens[: i + 1])) for i in range(p, len(tokens))),
      now=now,
  )


def _labels_along(tree, match):
  out = []
  for i, node_id in enumerate(match.path):
    value = tree.node(node_id).value
    out.extend(value if i + 1 < len(match.path) else value[: match.last_offset])
  return out


class RadixTreeTest(parameterized.TestCase):

  def test_insert_and_match_basic(self):
    tree = RadixTree()
    r = tree.insert("ns", [1, 2, 3, 4], now=1.0)
    self.assertEqual(r.prefix_len, 0)
    self.assertIsNotNone(r.leaf)
    self.assertEqual(tree.num_tokens, 4)
    m = tree.match_prefix("ns", [1, 2, 3, 4, 5], now=2.0)
    self.assertEqual((m.length, m.path, m.last_offset), (4, (r.leaf,), 4))
    m = tree.match_prefix("ns", [1, 2, 9], now=2.0)
    self.assertEqual((m.length, m.last_offset), (2, 2))
    self.assertEqual(tree.match_prefix("ns", [7], now=2.0).length, 0)
    self.assertEqual(tree.match_prefix("ns", [], now=2.0).length, 0)
    # Fully held: nothing new.
    r2 = tree.insert("ns", [1, 2], now=3.0)
    self.assertEqual((r2.prefix_len, r2.leaf, r2.splits), (2, None, ()))
    self.assertEqual(tree.num_tokens, 4)

  def test_keys_are_compact_int32_spans(self):
    tree = RadixTree()
    tree.insert("ns", np.arange(1000, dtype=np.int64), now=0.0)
    tree.insert("ns", np.r_[np.arange(500), [-5]], now=0.0)
    for node in tree.nodes():
      self.assertIsInstance(node.key, np.ndarray)
      self.assertEqual(node.key.dtype, np.int32)
      self.assertEqual(node.key.ndim, 1)
    self.assertEqual(len(tree), 3)
    self.assertEqual(tree.num_tokens, 1001)

  def test_split_at_every_token(self):
    base = list(range(100, 112))
    for t in range(len(base) + 1):
      with self.subTest(t=t):
        tree = _labelled_tree()
        a = _insert(tree, "ns", base)
        other = base[:t] + [7, 8]
        b = _insert(tree, "ns", other)
        self.assertEqual(b.prefix_len, t)
        if 0 < t < len(base):
          self.assertLen(b.splits, 1)
          split = b.splits[0]
          self.assertEqual((split.tail, split.offset), (a.leaf, t))
          head = tree.node(split.head)
          self.assertEqual(head.num_tokens, t)
          self.assertIs(tree.node(a.leaf).parent, head)
        else:
          self.assertEqual(b.splits, ())
        # Both sequences match in full and their labels are the ones inserted.
        for seq in (base, other):
          m = tree.match_prefix("ns", seq, now=1.0)
          self.assertEqual(m.length, len(seq))
          labels = _labels_along(tree, m)
          self.assertEqual(labels, [("v", "ns", tuple(seq[: i + 1])) for i in range(len(seq))])
        np.testing.assert_array_equal(tree.path_tokens(a.leaf), base)
        self.assertEqual(tree.num_tokens, len(base) + 2)
        leaves = [tuple(other)] + ([tuple(base)] if t < len(base) else [])
        self.assertEqual(sorted(tuple(s.tolist()) for s in tree.sequences("ns")), sorted(leaves))

  @parameterized.parameters(1, 3, 5)
  def test_explicit_split_keeps_id_lock_and_leafness(self, offset):
    tree = _labelled_tree()
    leaf = _insert(tree, "ns", range(6)).leaf
    tree.lock(leaf)
    tree.pin(leaf, until=10.0)
    head = tree.split(leaf, offset)
    h, t = tree.node(head), tree.node(leaf)
    np.testing.assert_array_equal(h.key, np.arange(offset))
    np.testing.assert_array_equal(t.key, np.arange(offset, 6))
    self.assertEqual((h.lock_ref, t.lock_ref), (1, 1))
    self.assertEqual((h.pinned_until, t.pinned_until), (10.0, 10.0))
    self.assertEqual(t.depth, offset)
    self.assertTrue(t.is_leaf)
    self.assertFalse(h.is_leaf)
    self.assertEqual(len(h.value) + len(t.value), 6)
    tree.unlock(leaf)  # unlock after the split balances both nodes
    self.assertEqual((h.lock_ref, t.lock_ref), (0, 0))
    with self.assertRaises(LockError):
      tree.unlock(leaf)
    with self.assertRaises(ValueError):
      tree.split(leaf, 0)
    with self.assertRaises(ValueError):
      tree.split(leaf, t.num_tokens)

  def test_namespaces_isolated_with_per_namespace_stats(self):
    tree = RadixTree()
    tree.insert("tenant_a", [1, 2, 3], now=0.0)
    self.assertEqual(tree.match_prefix("tenant_b", [1, 2, 3], now=1.0).length, 0)
    tree.insert(("adapter", 7), [1, 2, 3, 4], now=0.0)
    self.assertEqual(tree.match_prefix("tenant_a", [1, 2, 3, 4], now=1.0).length, 3)
    self.assertEqual(tree.match_prefix(("adapter", 7), [1, 2, 3, 4], now=1.0).length, 4)
    self.assertEqual(tree.stats("tenant_b"), HitStats(1, 0, 3, 0))
    self.assertEqual(tree.stats("tenant_a"), HitStats(1, 1, 4, 3))
    self.assertEqual(tree.stats(("adapter", 7)), HitStats(1, 1, 4, 4))
    self.assertEqual(tree.stats(), HitStats(3, 2, 11, 7))
    self.assertAlmostEqual(tree.stats().hit_rate, 7 / 11)
    self.assertEqual(tree.stats("never_seen").hit_rate, 0.0)
    # Nodes never cross namespaces.
    for node in tree.nodes():
      self.assertIn(node.namespace, ("tenant_a", ("adapter", 7)))
    with self.assertRaises(TypeError):
      tree.insert(["unhashable"], [1], now=0.0)

  def test_access_time_hits_and_read_only_probe(self):
    tree = RadixTree()
    a = tree.insert("ns", [1, 2, 3, 4], now=1.0).leaf
    b = tree.insert("ns", [1, 2, 9], now=2.0).leaf
    head = tree.node(a).parent
    self.assertEqual(head.last_access, 2.0)
    self.assertEqual(tree.node(a).last_access, 1.0)
    seq_before = tree.node(b).access_seq
    m = tree.match_prefix("ns", [1, 2, 9], now=5.0, record=False)
    self.assertEqual(m.length, 3)
    self.assertEqual((tree.node(b).last_access, tree.node(b).access_seq), (2.0, seq_before))
    self.assertEqual(tree.stats(), HitStats())
    tree.match_prefix("ns", [1, 2, 3], now=6.0)
    self.assertEqual(tree.node(a).last_access, 6.0)
    self.assertEqual((tree.node(a).hit_count, tree.node(a).hit_tokens), (1, 1))
    self.assertEqual((head.hit_count, head.hit_tokens), (1, 2))
    self.assertGreater(tree.node(a).access_seq, tree.node(b).access_seq)

  def test_remove_leaf_and_locks(self):
    tree = RadixTree()
    a = tree.insert("ns", [1, 2, 3], now=0.0).leaf
    b = tree.insert("ns", [1, 2, 4], now=0.0).leaf
    head = tree.node(a).parent.node_id
    with self.assertRaises(LockError):
      tree.remove_leaf(head)  # has children
    tree.lock(a)
    self.assertEqual(tree.node(head).lock_ref, 1)
    with self.assertRaises(LockError):
      tree.remove_leaf(a)
    tree.remove_leaf(b)
    self.assertEqual({n.node_id for n in tree.leaves()}, {a})
    tree.unlock(a)
    tree.remove_leaf(a)
    self.assertEqual({n.node_id for n in tree.leaves()}, {head})
    tree.remove_leaf(head)
    self.assertEqual((len(tree), tree.num_tokens), (0, 0))
    self.assertEqual(tree.namespaces(), [])
    with self.assertRaises(StaleNodeError):
      tree.node(a)
    with self.assertRaises(StaleNodeError):
      tree.lock(a)
    # Ids are never reused.
    c = tree.insert("ns", [1], now=0.0).leaf
    self.assertNotIn(c, (a, b, head))

  def test_unpin_clears_subtree(self):
    tree = RadixTree()
    a = tree.insert("ns", [1, 2, 3], now=0.0).leaf
    tree.insert("ns", [1, 2, 4], now=0.0)
    tree.pin(a, until=5.0)
    head = tree.node(a).parent
    self.assertTrue(head.is_pinned(1.0))
    self.assertFalse(head.is_pinned(5.0))
    tree.unpin(head.node_id)
    self.assertFalse(tree.node(a).is_pinned(1.0))

  @parameterized.named_parameters(
      ("two_d", [[1, 2]]),
      ("floats", [1.5, 2.0]),
      ("bools", [True, False]),
      ("too_big", [2**31]),
      ("ragged", [[1], [1, 2]]),
  )
  def test_invalid_tokens_raise_and_change_nothing(self, tokens):
    tree = RadixTree()
    tree.insert("ns", [1, 2], now=0.0)
    with self.assertRaises(InvalidTokensError):
      tree.insert("ns", tokens, now=1.0)
    with self.assertRaises(InvalidTokensError):
      tree.match_prefix("ns", tokens, now=1.0)
    self.assertEqual((len(tree), tree.num_tokens), (1, 2))
    self.assertEqual(tree.stats(), HitStats())

  def test_as_tokens_no_copy_for_valid_input(self):
    arr = np.arange(5, dtype=np.int32)
    self.assertIs(as_tokens(arr), arr)
    self.assertEqual(as_tokens([]).dtype, np.int32)

  def test_namespace_keys_are_capped_without_recursion(self):
    """Issue P item 4: a namespace nested 5,000 tuples deep raised RecursionError."""
    from radix import tree as tree_lib  # pylint: disable=g-import-not-at-top
    deep = "t"
    for _ in range(5000):
      deep = (deep,)
    ok = ("tenant", 7, b"x", ("a", ("b", 1)))
    self.assertIs(tree_lib.check_namespace(ok), ok)
    for bad, part in ((deep, "MAX_NAMESPACE_DEPTH"),
                      (tuple(range(tree_lib.MAX_NAMESPACE_PARTS + 1)), "MAX_NAMESPACE_PARTS"),
                      (tuple((i,) for i in range(40)) * 2, "MAX_NAMESPACE_PARTS"),
                      ("x" * (tree_lib.MAX_NAMESPACE_LENGTH + 1), "MAX_NAMESPACE_LENGTH"),
                      (b"x" * (tree_lib.MAX_NAMESPACE_LENGTH + 1), "MAX_NAMESPACE_LENGTH"),
                      (2**63, "int64"), (("a", -2**63 - 1), "int64")):
      with self.subTest(part=part), self.assertRaisesRegex(InvalidNamespaceError, part):
        tree_lib.check_namespace(bad)
    tree = RadixTree()
    with self.assertRaises(InvalidNamespaceError):
      tree.insert(deep, [1, 2], now=0.0)
    self.assertEqual(len(tree), 0)

  def test_tree_imports_neither_jax_nor_paged_kv(self):
    code = (
        "import sys, radix.tree, radix.cache; "
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.') "
        "or m.startswith('paged_kv')]; print(bad); assert not bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


if __name__ == "__main__":
  absltest.main()

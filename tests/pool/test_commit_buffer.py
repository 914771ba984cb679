"""A window's packed commit holds every field where `CommitBatch` reads it.

`changes._batch` writes runs of same-shaped fields through one view each
(`CommitLayout.group`); unpacking the buffer (the program's own view) must give back
each field's values, padding after them, for every kind of entry (blocks, slot words,
scrub flags, rows before and after, segments, copies, moves, totals).
"""

from __future__ import annotations

import numpy as np
from absl.testing import absltest, parameterized

import paged_kv
from paged_kv.core.commit import _FIELDS
from paged_kv.pool import changes


class CommitBufferTest(parameterized.TestCase):

  @parameterized.parameters(4, 64)  # one slot word, two
  def test_every_field_unpacks_to_what_was_written(self, block_size):
    cfg = paged_kv.PoolConfig(num_blocks=64, block_size=block_size, num_layers=1,
                              num_kv_heads=1, head_dim=2, max_seqs=8, max_segments=4)
    host = paged_kv.BlockPool(cfg).host
    rng = np.random.default_rng(block_size)
    w = cfg.slot_words
    host.ref_count[:] = rng.integers(0, 5, 64)
    host.slots[:] = rng.integers(0, 2**32, (64, w), dtype=np.uint64).astype(np.uint32)
    for name in ("block", "start", "length"):
      getattr(host, name)[:] = rng.integers(0, 9, (8, 4))
    host.num_segments[:], host.seq_len[:] = rng.integers(0, 5, 8), rng.integers(0, 99, 8)
    host.active[:] = rng.integers(0, 2, 8).astype(bool)
    host.step = 17
    ids, rows = np.array([5, 9, 2]), np.array([6, 1])
    old_ref = np.array([1, 0, 3])
    old_slots = rng.integers(0, 2**32, (3, w), dtype=np.uint64).astype(np.uint32)
    scrub = np.array([[True, False], [False, True], [False, False]])
    old_rows = np.array([[3, 7, 1], [2, 5, 0]])
    copies, moves = rng.integers(0, 9, (2, 5)), rng.integers(0, 60, (3, 2))
    expected = np.array([10, 2, 30, 4, 16])
    widths = changes.CommitWidths(blocks=8, rows=8, copies=8, moves=64)
    packed = changes._batch(host, widths, ids, old_ref, old_slots, scrub, rows, old_rows,
                            copies, moves, expected)  # pylint: disable=protected-access
    got = packed.layout.unpack(packed.buf)
    want = {
        "block_ids": ids, "old_ref": old_ref, "new_ref": host.ref_count[ids],
        "old_slots": old_slots, "new_slots": host.slots[ids],
        "scrub_before": scrub[:, 0], "scrub_after": scrub[:, 1],
        "rows": rows, "old_num_segments": old_rows[:, 0], "old_seq_len": old_rows[:, 1],
        "old_active": old_rows[:, 2].astype(bool), "row_block": host.block[rows],
        "row_start": host.start[rows], "row_length": host.length[rows],
        "row_num_segments": host.num_segments[rows], "row_seq_len": host.seq_len[rows],
        "row_active": host.active[rows], "expected": expected,
        **{name: copies[:, j] for j, name in enumerate(
            ("copy_src_block", "copy_src_start", "copy_dst_block", "copy_dst_start",
             "copy_length"))},
        "move_src": moves[:, 0], "move_dst": moves[:, 1],
    }
    for name, _, fill, _ in _FIELDS:
      value = np.asarray(getattr(got, name))
      if name in want:
        n = len(want[name])
        np.testing.assert_array_equal(value[:n], want[name], err_msg=name)
        np.testing.assert_array_equal(value[n:], fill, err_msg=name + " (padding)")
    self.assertTrue(bool(got.check_totals))
    self.assertEqual(int(got.step), 17)


if __name__ == "__main__":
  absltest.main()

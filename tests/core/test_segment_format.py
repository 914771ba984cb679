"""The host segment format: `Segments` (`int32[n, 3]` rows `(block, start, length)`)."""

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from paged_kv.core import segment_format
from paged_kv.core.errors import InvalidArgument, InvalidSegmentLayout

SEGS = np.array([[1, 0, 4], [2, 0, 3], [5, 1, 2]], np.int32)


class AsSegmentsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("numpy", SEGS), ("int64", SEGS.astype(np.int64)), ("lists", SEGS.tolist()),
      ("tuples", [tuple(r) for r in SEGS.tolist()]), ("jax", jnp.asarray(SEGS)))
  def test_accepts_rows(self, segs):
    out = segment_format.as_segments(segs)
    self.assertEqual((out.dtype, out.shape), (np.int32, (3, 3)))
    self.assertTrue(out.flags.c_contiguous)
    np.testing.assert_array_equal(out, SEGS)

  @parameterized.parameters(([],), ((),), (np.zeros((0, 3), np.int64),),
                            (np.zeros((0,), np.float32),))
  def test_empty_is_no_segment(self, segs):
    self.assertEqual(segment_format.as_segments(segs).shape, (0, 3))

  @parameterized.named_parameters(
      ("columns", (SEGS[:, 0], SEGS[:, 1], SEGS[:, 2]), "a tuple of three 1-D arrays"),
      ("transposed", SEGS[:2].T, r"got shape \(3, 2\) int32 \(three columns\?"),
      ("floats", SEGS.astype(np.float32), r"got shape \(3, 3\) float32"),
      ("bools", SEGS.astype(bool), r"got shape \(3, 3\) bool"),
      ("flat", SEGS.reshape(-1), r"got shape \(9,\) int32"),
      ("three_d", SEGS[None], r"got shape \(1, 3, 3\) int32"),
      ("ragged", [[1, 2, 3], [4]], "got list"),
      ("overflow", SEGS.astype(np.int64) * 2**31, "values outside int32"))
  def test_wrong_layout_names_both_shapes(self, segs, message):
    with self.assertRaisesRegex(InvalidSegmentLayout, message) as raised:
      segment_format.as_segments(segs, name="extra_segments")
    self.assertStartsWith(str(raised.exception), "extra_segments must be an int32[n, 3] array "
                          "of (block, start, length) rows; got")
    self.assertIsInstance(raised.exception, InvalidArgument)  # and a ValueError


class TakeTokensTest(parameterized.TestCase):

  @parameterized.parameters(
      (0, []), (1, [[1, 0, 1]]), (4, [[1, 0, 4]]), (5, [[1, 0, 4], [2, 0, 1]]),
      (7, [[1, 0, 4], [2, 0, 3]]), (8, [[1, 0, 4], [2, 0, 3], [5, 1, 1]]), (9, SEGS.tolist()))
  def test_cuts_the_straddling_segment(self, count, want):
    out = segment_format.take_tokens(SEGS, count)
    np.testing.assert_array_equal(out, np.asarray(want, np.int32).reshape(-1, 3))
    self.assertEqual(segment_format.num_tokens(out), count)
    np.testing.assert_array_equal(SEGS[2], [5, 1, 2])  # the input is not changed

  @parameterized.parameters(-1, 10)
  def test_count_outside_the_tokens(self, count):
    with self.assertRaises(InvalidArgument):
      segment_format.take_tokens(SEGS, count)


if __name__ == "__main__":
  absltest.main()

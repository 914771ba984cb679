"""The test tiers (tests/conftest.py) name tests that exist, and CI runs every test.

`make test-fast` skips `slow`, `make test` skips `long` and `make test-long` runs only
`long`; `.ci/run` runs the last two. A renamed or deleted test would leave a stale
entry that silently marks nothing: each entry must name a file, class or test
function that exists (a parameterised test's generated names extend its function's).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from tests import conftest

_TESTS = pathlib.Path(__file__).resolve().parent
_ROOT = _TESTS.parent


def _defined(tree: ast.Module, names: list[str]) -> bool:
  """Whether `Class::test` (or `test`) names a definition of the module."""
  scope = tree.body
  for i, name in enumerate(names):
    last = i == len(names) - 1
    found = None
    for node in scope:
      if isinstance(node, ast.ClassDef) and node.name == name:
        found = node
      elif last and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
          name.startswith(node.name)):
        found = node
    if found is None:
      return False
    scope = getattr(found, "body", [])
  return True


@pytest.mark.parametrize("spec", conftest._SLOW + conftest._LONG)
def test_every_tier_entry_names_a_test(spec):
  path, *names = spec.split("::")
  target = _TESTS / path
  if spec.endswith("/"):
    assert target.is_dir(), f"{spec}: no such test directory"
    return
  assert target.is_file(), f"{spec}: no such test module"
  if names:
    tree = ast.parse(target.read_text())
    assert _defined(tree, names), f"{spec}: no such class or test in {path}"


def test_long_and_slow_entries_are_distinct():
  assert not set(conftest._SLOW) & set(conftest._LONG)


def test_make_test_and_test_long_are_complements_and_ci_runs_both():
  make = (_ROOT / "Makefile").read_text()
  marks = dict(re.findall(r'^(test(?:-long)?):.*\n\t.*pytest.* -m "?([^"\n]+?)"? tests$', make,
                          re.M))
  assert marks == {"test": "not long", "test-long": "long"}, marks
  ci = (_ROOT / ".ci" / "run").read_text()
  assert re.search(r"^make test$", ci, re.M) and re.search(r"^make test-long$", ci, re.M)

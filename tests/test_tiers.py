"""The test tiers are marks on the tests, placed where pytest applies them, and CI runs
every test.

`make test-fast` skips `slow`, `make test` skips `long` and `make test-long` runs only
`long`; `.ci/run` runs the last two. A tier mark that pytest does not apply fails
nothing by itself: a test in a tier would run in `make test-fast` or twice in CI, or
(a mark above `@parameterized`/`@chex.variants`) not at all. So every tier mark must be
one pytest reads: a decorator of a test function or class (below absl's and chex's
generators), a module's `pytestmark`, a `pytest.param(marks=...)`, or a mark applied by
name to a test a generator made.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from tests import conftest

_TESTS = pathlib.Path(__file__).resolve().parent
_ROOT = _TESTS.parent
TIERS = ("slow", "long")
_GENERATORS = ("parameterized.", "chex.")  # decorators that replace the method by others


def _mark_name(node: ast.AST) -> str | None:
  """`X` for the expression `pytest.mark.X` (or `pytest.mark.X(...)`), else None."""
  if isinstance(node, ast.Call):
    node = node.func
  if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
      and node.value.attr == "mark" and isinstance(node.value.value, ast.Name)
      and node.value.value.id == "pytest"):
    return node.attr
  return None


def misplaced_tier_marks(source: str) -> list[str]:
  """Each tier mark of a test module's source that pytest would not apply (line: why)."""
  tree = ast.parse(source)
  classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
  applied: set[int] = set()  # ids of the mark expressions pytest reads
  bad = []

  def apply(marks: list[ast.expr]) -> None:
    for m in marks:
      applied.update((id(m), id(m.func)) if isinstance(m, ast.Call) else (id(m),))

  bodies = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
      names = [_mark_name(d) for d in node.decorator_list]
      for i, (d, name) in enumerate(zip(node.decorator_list, names)):
        if name not in TIERS:
          continue
        below = [ast.unparse(x) for x in node.decorator_list[i + 1:]]
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("test"):
          bad.append(f"{d.lineno}: @pytest.mark.{name} on {node.name}, not a test")
        elif any(b.startswith(_GENERATORS) for b in below):
          bad.append(f"{d.lineno}: @pytest.mark.{name} above a generator's decorator: "
                     "put it right above `def`")
        apply([d])
    elif isinstance(node, ast.Assign) and any(node in b for b in bodies) and any(
        isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
      apply(node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value])
    elif isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.param":
      for kw in node.keywords:
        if kw.arg == "marks":
          apply(kw.value.elts if isinstance(kw.value, (ast.List, ast.Tuple)) else [kw.value])
    elif (isinstance(node, ast.Expr) and node in tree.body and isinstance(node.value, ast.Call)
          and _mark_name(node.value.func) in TIERS):
      # `pytest.mark.slow(Class.test_generated_name)`: a test made by a generator.
      args = node.value.args
      if not (len(args) == 1 and isinstance(args[0], ast.Attribute)
              and isinstance(args[0].value, ast.Name) and args[0].value.id in classes
              and args[0].attr.startswith("test")):
        bad.append(f"{node.lineno}: {ast.unparse(node)} names no test of a class here")
      apply([node.value])
  for node in ast.walk(tree):
    if _mark_name(node) in TIERS and id(node) not in applied:
      bad.append(f"{node.lineno}: {ast.unparse(node)} is not applied to a test")
  return sorted(set(bad))


def _test_modules() -> list[pathlib.Path]:
  return sorted(p for p in _TESTS.rglob("test_*.py"))


def test_every_tier_mark_is_one_pytest_applies():
  bad = {str(p.relative_to(_TESTS)): b for p in _test_modules()
         if (b := misplaced_tier_marks(p.read_text()))}
  assert not bad, bad


def test_the_check_finds_misplaced_marks():
  ok = '''
import pytest
pytestmark = pytest.mark.slow
class T:
  @chex.variants(with_jit=True)
  @pytest.mark.long
  def test_a(self): pass
@pytest.mark.long
@pytest.mark.parametrize("x", [pytest.param(1, marks=pytest.mark.long)])
def test_b(x): pass
pytest.mark.slow(T.test_a__with_jit)
'''
  assert misplaced_tier_marks(ok) == []
  assert misplaced_tier_marks("import pytest\npytest_mark = pytest.mark.slow\n") == [
      "2: pytest.mark.slow is not applied to a test"]
  assert misplaced_tier_marks(
      "class T:\n  @pytest.mark.slow\n  @parameterized.parameters(1)\n  def test_a(self, x): pass\n"
  ) == ["2: @pytest.mark.slow above a generator's decorator: put it right above `def`"]
  assert misplaced_tier_marks("@pytest.mark.long\ndef helper(): pass\n") == [
      "1: @pytest.mark.long on helper, not a test"]
  assert misplaced_tier_marks("pytest.mark.long(Gone.test_a)\n") == [
      "1: pytest.mark.long(Gone.test_a) names no test of a class here"]


def test_every_mark_used_is_registered(pytestconfig):
  registered = {line.split(":")[0].split("(")[0] for line in pytestconfig.getini("markers")}
  assert set(TIERS) <= registered
  used = {}
  for path in _test_modules():
    for node in ast.walk(ast.parse(path.read_text())):
      if (name := _mark_name(node)) is not None:
        used.setdefault(name, str(path.relative_to(_TESTS)))
  assert {n: p for n, p in used.items() if n not in registered} == {}
  # An unregistered mark is a collection error (a misspelt tier would select nothing).
  assert "--strict-markers" in pytestconfig.getini("addopts")


class _Item:
  """The two methods of `pytest.Item` the tiers' rule uses."""

  def __init__(self, *marks: str):
    self.marks = [getattr(pytest.mark, m).mark for m in marks]

  def get_closest_marker(self, name):
    return next((m for m in self.marks if m.name == name), None)

  def add_marker(self, marker):
    self.marks.append(marker.mark)


def test_a_long_test_is_also_slow():
  items = [_Item("long"), _Item("slow"), _Item(), _Item("long", "slow")]
  conftest.pytest_collection_modifyitems(None, items)
  assert [sorted(m.name for m in i.marks) for i in items] == [
      ["long", "slow"], ["slow"], [], ["long", "slow"]]


def test_make_test_and_test_long_are_complements_and_ci_runs_both():
  make = (_ROOT / "Makefile").read_text()
  marks = dict(re.findall(r'^(test(?:-long)?):.*\n\t.*pytest.* -m "?([^"\n]+?)"? tests$', make,
                          re.M))
  assert marks == {"test": "not long", "test-long": "long"}, marks
  ci = (_ROOT / ".ci" / "run").read_text()
  assert re.search(r"^make test$", ci, re.M) and re.search(r"^make test-long$", ci, re.M)

"""The package's shape: folders import one way (each only from the folders below it),
no folder holds over a fifth of the library, no class runs over 500 lines, and the
prose fits the code (`tools/code_shape.py` measures the last three).

The order is the README's layout table; an import from a higher folder (at module
level or inside a function) is an arrow back up, and two folders importing each other
a circle. `radix` and `pallas_kernels` import nothing of `paged_kv`.
"""

import ast
import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Bottom to top: a folder may import the folders before it, never those after it.
ORDER = ("core", "runtime", "pool", "telemetry", "model", "cache", "scheduler", "parallel",
         "cluster", "entrypoints", "sim")


def _imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
  out = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      out.append((node.lineno, node.module))
      out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
  return out


def _folder_of(module: str) -> str | None:
  parts = module.split(".")
  if parts[0] != "paged_kv" or len(parts) < 2:
    return None
  return parts[1] if parts[1] in ORDER else None


def test_every_package_folder_is_in_the_order():
  folders = {p.name for p in (ROOT / "paged_kv").iterdir()
             if p.is_dir() and (p / "__init__.py").exists()}
  assert folders == set(ORDER), folders ^ set(ORDER)


@pytest.mark.parametrize("folder", ORDER)
def test_a_folder_imports_only_folders_below_it(folder):
  rank = ORDER.index(folder)
  upward = []
  for path in sorted((ROOT / "paged_kv" / folder).rglob("*.py")):
    for line, module in _imported_modules(path):
      target = _folder_of(module)
      if target is not None and ORDER.index(target) > rank:
        upward.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
  assert not upward, "\n".join(upward)


@pytest.mark.parametrize("package", ["radix", "pallas_kernels"])
def test_the_leaf_packages_import_nothing_of_paged_kv(package):
  bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
         for path in sorted((ROOT / package).rglob("*.py"))
         for line, module in _imported_modules(path) if module.split(".")[0] == "paged_kv"]
  assert not bad, "\n".join(bad)



def _code_shape():
  spec = importlib.util.spec_from_file_location("code_shape", ROOT / "tools" / "code_shape.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod  # its dataclasses look their module up
  spec.loader.exec_module(mod)
  return mod.measure(ROOT)


@pytest.fixture(scope="module")
def shape():
  return _code_shape()


def test_no_folder_holds_over_a_fifth_of_the_library(shape):
  big = {f: n for f, n in shape.folders.items() if n > 0.2 * shape.lines}
  assert not big, f"over 20% of {shape.lines} lines: {big}"


def test_no_class_over_500_lines(shape):
  assert not shape.long_classes, "\n".join(f"{p}: {c} {n}" for p, c, n in shape.long_classes)


def test_prose_fits_the_code(shape):
  """Docstrings at most a fifth of the library; no private docstring longer than its
  function's code; no comment or docstring citing an issue instead of saying why."""
  assert shape.doc_lines <= 0.2 * shape.lines, (shape.doc_lines, shape.lines)
  private = [f"{d.path}: {d.name}" for d in shape.long_docs if not d.public]
  assert not private, "\n".join(private)
  assert not shape.issue_cites, "\n".join(f"{p}:{i}" for p, i, _ in shape.issue_cites)

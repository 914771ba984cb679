"""The package's folders import one way: each folder only from the folders below it.

The order is the README's layout table; an import from a higher folder (at module
level or inside a function) is an arrow back up, and two folders importing each other
a circle. `radix` and `pallas_kernels` import nothing of `paged_kv`.
"""

import ast
import pathlib

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

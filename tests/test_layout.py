"""The package's shape: folders import one way (each only from the folders below it),
no folder holds over a fifth of the library, no class runs over 500 lines.

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


def _library_files():
  for package in ("paged_kv", "radix", "pallas_kernels"):
    yield from sorted((ROOT / package).rglob("*.py"))


def test_no_folder_holds_over_a_fifth_of_the_library():
  lines: dict[str, int] = {}
  for path in _library_files():
    rel = path.relative_to(ROOT).parts
    folder = "/".join(rel[:2]) if rel[0] == "paged_kv" and len(rel) > 2 else rel[0]
    lines[folder] = lines.get(folder, 0) + len(path.read_text().splitlines())
  total = sum(lines.values())
  big = {f: n for f, n in lines.items() if n > 0.2 * total}
  assert not big, f"over 20% of {total} lines: {big}"


def test_no_class_over_500_lines():
  long = [f"{path.relative_to(ROOT)}: {node.name} {node.end_lineno - node.lineno + 1}"
          for path in _library_files() for node in ast.walk(ast.parse(path.read_text()))
          if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno >= 500]
  assert not long, "\n".join(long)

"""The library's shape in numbers: folder shares, prose share, long classes, stale cites.

Measures the package folders (`paged_kv/`, `radix/`, `pallas_kernels/`) from their
source text and prints one table per question:

* lines per folder and its share of the library (a folder over 20% is a drawer);
* docstring lines as a share of all lines;
* functions whose docstring is longer than their code (public entry points, the
  names a package's `__all__` exports and their classes' public methods, apart);
* classes over 500 lines;
* code that cites an issue letter or number (`issue K`, `#12`) instead of saying why.

Usage: python tools/code_shape.py [--root .] [--json]
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import pathlib
import re

PACKAGES = ("paged_kv", "radix", "pallas_kernels")
ISSUE_CITE = re.compile(r"\b[Ii]ssues? [A-Z]\b|\b[Ii]ssues? #?\d+|\(#\d+\)")


@dataclasses.dataclass
class LongDoc:
  """A function or class whose docstring has more lines than its code."""
  path: str
  name: str
  doc_lines: int
  code_lines: int
  public: bool


@dataclasses.dataclass
class Shape:
  """Everything the tables print."""
  lines: int = 0
  doc_lines: int = 0
  folders: dict[str, int] = dataclasses.field(default_factory=dict)
  folder_docs: dict[str, int] = dataclasses.field(default_factory=dict)
  long_docs: list[LongDoc] = dataclasses.field(default_factory=list)
  long_classes: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)
  issue_cites: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)


def _folder(rel: pathlib.Path) -> str:
  """`paged_kv/<sub>` (or a top-level file of paged_kv), else the package."""
  return "/".join(rel.parts[:2]) if rel.parts[0] == "paged_kv" else rel.parts[0]


def _exported(root: pathlib.Path) -> set[str]:
  """Names listed in some package's `__all__`: the public entry points."""
  names: set[str] = set()
  for path in root.rglob("*.py"):
    if any(p.startswith(".") for p in path.parts):
      continue
    try:
      tree = ast.parse(path.read_text())
    except SyntaxError:
      continue
    for node in tree.body:
      if isinstance(node, ast.Assign) and any(
          isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
        if isinstance(node.value, (ast.List, ast.Tuple)):
          names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
  return names


def _doc_span(node) -> tuple[int, int] | None:
  body = getattr(node, "body", None)
  if not body:
    return None
  first = body[0]
  if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
      and isinstance(first.value.value, str)):
    return first.lineno, first.end_lineno
  return None


def measure(root: pathlib.Path) -> Shape:
  """Reads every package file under `root`."""
  shape = Shape()
  exported = set()
  for pkg in PACKAGES:
    exported |= _exported(root / pkg)
  for pkg in PACKAGES:
    for path in sorted((root / pkg).rglob("*.py")):
      rel = path.relative_to(root)
      text = path.read_text()
      n = len(text.splitlines())
      shape.lines += n
      folder = _folder(rel)
      shape.folders[folder] = shape.folders.get(folder, 0) + n
      tree = ast.parse(text)
      doc_lines: set[int] = set()
      owner = {id(f): c.name for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
               for f in c.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
      # Module, class and function docstrings, and the string right after an
      # assignment (an attribute's docstring).
      for node in ast.walk(tree):
        span = _doc_span(node) if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if span:
          doc_lines.update(range(span[0], span[1] + 1))
        if isinstance(node, (ast.Module, ast.ClassDef)):
          for a, b in zip(node.body, node.body[1:]):
            if (isinstance(a, (ast.Assign, ast.AnnAssign)) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
              doc_lines.update(range(b.lineno, b.end_lineno + 1))
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
          total = node.end_lineno - node.lineno + 1
          if isinstance(node, ast.ClassDef) and total > 500:
            shape.long_classes.append((rel.as_posix(), node.name, total))
          if span and not isinstance(node, ast.ClassDef):
            doc = span[1] - span[0] + 1
            code = total - doc  # the signature counts as code
            if doc > code:
              cls = owner.get(id(node))
              public = (node.name in exported if cls is None else
                        cls in exported and not node.name.startswith("_"))
              name = node.name if cls is None else f"{cls}.{node.name}"
              shape.long_docs.append(LongDoc(rel.as_posix(), name, doc, code, public))
      shape.doc_lines += len(doc_lines)
      shape.folder_docs[folder] = shape.folder_docs.get(folder, 0) + len(doc_lines)
      for i, line in enumerate(text.splitlines(), 1):
        if ISSUE_CITE.search(line):
          shape.issue_cites.append((rel.as_posix(), i, line.strip()))
  return shape


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--root", default=".", help="the repository's root")
  parser.add_argument("--json", action="store_true", help="one JSON object instead of tables")
  parser.add_argument("--list", action="store_true", help="list every long docstring and cite")
  args = parser.parse_args()
  shape = measure(pathlib.Path(args.root))
  if args.json:
    print(json.dumps(dataclasses.asdict(shape), indent=1))
    return
  print(f"{'folder':<28} {'lines':>7} {'share':>6} {'docstrings':>10}")
  for folder, n in sorted(shape.folders.items(), key=lambda kv: -kv[1]):
    print(f"{folder:<28} {n:>7} {n / shape.lines:>6.1%} {shape.folder_docs[folder] / n:>10.1%}")
  print(f"{'library':<28} {shape.lines:>7}")
  print(f"\ndocstring lines: {shape.doc_lines} ({shape.doc_lines / shape.lines:.1%} of the library)")
  private = [d for d in shape.long_docs if not d.public]
  print(f"docstring longer than its code: {len(shape.long_docs)} "
        f"({len(private)} not public entry points)")
  print(f"classes over 500 lines: {len(shape.long_classes)}")
  for path, name, n in shape.long_classes:
    print(f"  {path}: {name} {n}")
  print(f"lines citing an issue: {len(shape.issue_cites)}")
  if args.list:
    for d in private:
      print(f"  long doc {d.path}: {d.name} doc {d.doc_lines} code {d.code_lines}")
    for path, i, line in shape.issue_cites:
      print(f"  cite {path}:{i}: {line[:100]}")


if __name__ == "__main__":
  main()

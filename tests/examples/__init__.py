"""Tests of the example scripts: subprocess smoke runs, and unit tests of a script's logic.

`load_example(name)` loads `examples/<name>.py` as a module for a test of its own
functions (the study's admission, say) without putting `examples/` on `sys.path`:
the library, the tools and every other test never import a script
(`tests/test_imports.py`).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

_EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str) -> ModuleType:
  """`examples/<name>.py` as a module (loaded once per process; its absl flags defined)."""
  key = f"_paged_kv_example_{name}"
  if key not in sys.modules:
    spec = importlib.util.spec_from_file_location(key, _EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
  return sys.modules[key]

"""Optional dependencies of the model layer, imported when first needed; errors name the extra."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, *, needed_for: str, extra: str) -> ModuleType:
  """`module`, imported; else `ModuleNotFoundError` naming `pip install 'paged-kv[extra]'`."""
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as err:
    if err.name != module:
      raise
    raise ModuleNotFoundError(f"{needed_for} needs {module}; install it with: "
                              f"pip install 'paged-kv[{extra}]'", name=module) from err

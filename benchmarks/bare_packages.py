"""Import a package's submodules without running the package's `__init__`.

A peer package's `__init__` imports every model it ships, each with its own dependencies
(scipy, opencv, ...), none of which the one model file a benchmark reads needs. An empty module
standing in for the package, with the package's real search path, finds the submodules."""

from __future__ import annotations

import importlib.util
import sys
import types


def bare_packages(*names: str) -> bool:
    """Stand an empty module in for each dotted package name (parents first). False when the
    top package is not installed; names already imported are left as they are."""
    if importlib.util.find_spec(names[0].partition(".")[0]) is None:
        return False
    for name in names:
        if name in sys.modules:
            continue
        parent, _, leaf = name.rpartition(".")
        if parent:
            path = [f"{p}/{leaf}" for p in sys.modules[parent].__path__]
        else:
            path = list(importlib.util.find_spec(name).submodule_search_locations)
        package = types.ModuleType(name)
        package.__path__ = path
        sys.modules[name] = package
    return True

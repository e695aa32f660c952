"""The repository's scripts (benchmarks, docs, images, examples) imported by path, as the tests of them need."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str | None = None) -> ModuleType:
    """The script at `relative` (to the repository root) as a module, registered under `name` (its stem by default)
    in sys.modules, where dataclasses and pickling look a module up."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

"""The scripts under tools/ as modules, for the CPU tests of their arithmetic (they are scripts, not a package)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str) -> ModuleType:
    """tools/<name>.py, executed as module `name` and registered in sys.modules (dataclasses look it up there)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

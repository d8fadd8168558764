"""The ``torch.backends`` entry point. It runs while ``import torch`` is still finishing, so it stays trivial:
it imports nothing from torch and only arms a one-shot import hook that enables Flashlight right after
``torch._inductor.compile_fx`` is first imported (i.e. when Inductor is first used).
"""

import importlib.abc
import os
import sys

DISABLE_VARIABLE = "FLASHLIGHT_DISABLE"
_TRIGGER = "torch._inductor.compile_fx"


def disabled_by_environment() -> bool:
    return os.environ.get(DISABLE_VARIABLE, "0") not in ("", "0")


class _EnableAfterLoad(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        from flashlight import _enable_from_autoload

        _enable_from_autoload()


class _ArmOnInductorImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _EnableAfterLoad(spec.loader)
                return spec
        return None


def autoload() -> None:
    if disabled_by_environment():
        return
    if _TRIGGER in sys.modules:
        from flashlight import _enable_from_autoload

        _enable_from_autoload()
    elif not any(isinstance(finder, _ArmOnInductorImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ArmOnInductorImport())

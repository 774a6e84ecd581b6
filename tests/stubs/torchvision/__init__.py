"""A stub of torchvision, for tests only: NOT the real package.

Importing SGLang 0.5.23 (and transformers' image utilities it pulls in) imports a few torchvision
names at module load. The real torchvision wheel would replace this project's torch with another
version and CUDA wheels, so the SGLang plugin tests put this directory on sys.path instead. Every
`torchvision.*` submodule exists; `InterpolationMode` and `ImageReadMode` are real enums (they are
used at import time); every other name is a function that raises when called.
"""

import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


_ENUMS = {"InterpolationMode": InterpolationMode, "ImageReadMode": ImageReadMode}


def _module_getattr(module_name):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _ENUMS:
            return _ENUMS[name]

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{module_name}.{name} is not available: torchvision is a test stub")

        unavailable.__name__ = name
        return unavailable
    return __getattr__


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_StubFinder())
__getattr__ = _module_getattr(__name__)

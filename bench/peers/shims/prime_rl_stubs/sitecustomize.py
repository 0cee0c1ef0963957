"""Stand-ins for the GPU-only packages prime-rl's orchestrator imports (through its trainer's modules) though a
run on CPU with a fake trainer never calls them: each named package, and any module under it, imports as a stub
whose every attribute is a placeholder; calling one with a function or class returns it (a decorator), any
other call returns a placeholder, and using one as a base class works. Loaded by Python at start-up
(`sitecustomize`) when this folder is on the orchestrator's PYTHONPATH (bench/peers/prime_rl_peer.py).
"""

import importlib.abc
import importlib.machinery
import sys
import types

# The packages stubbed: GPU kernels, CUDA-only parallelism and transfer libraries (prime-rl's pyproject pins).
STUBBED = {"modelexpress", "torchtitan", "ring_flash_attn", "dion", "fla", "tilelang", "deep_ep", "deep_gemm", "nixl", "vllm"}  # fmt: skip


class _Meta(type):
    """Attributes of a placeholder class (`T.bfloat16`, `Enum.MEMBER`) are placeholder classes too."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Placeholder,), {"__module__": cls.__module__})


class _Placeholder(metaclass=_Meta):
    def __init__(self, *args, **kwargs):
        pass

    def __init_subclass__(cls, **kwargs):
        pass

    def __class_getitem__(cls, item):
        return cls

    def __getattr__(self, name):
        return _Placeholder()

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _Placeholder()

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Placeholder,), {"__module__": self.__name__})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())

"""The registry of built-in environments: the `register_env` decorator and the classes it registered."""

from __future__ import annotations

from typing import TypeVar

from beam_rl.envs.base import Environment

ENVIRONMENTS: dict[str, type[Environment]] = {}

_E = TypeVar("_E", bound=type[Environment])


def register_env(cls: _E) -> _E:
    """Class decorator: make `cls` constructible by `make_env(cls.name, ...)`."""
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"register_env expects an Environment subclass, got {cls!r}")
    if not cls.name:
        raise ValueError(f"{cls.__qualname__} has no `name` to register under")
    existing = ENVIRONMENTS.get(cls.name)
    # Re-registering the same class (a module imported twice) is harmless; two classes under one
    # name would make which one runs depend on import order.
    if existing is not None and _qualified(existing) != _qualified(cls):
        raise ValueError(f"environment {cls.name!r} is already registered by {_qualified(existing)}")
    ENVIRONMENTS[cls.name] = cls
    return cls


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"

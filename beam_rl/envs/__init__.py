"""The environment registry: environments register by name; the pipeline builds them with `make_env`.

Bundled: `arithmetic`, `arithmetic_easy` (the config a tiny model learns in minutes), `reverse_text`,
`guess_number` (multi-turn), `code` (programs run in a sandbox).
"""

from __future__ import annotations

from typing import Any, TypeVar

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


def make_env(name: str, tokenizer: Any, **kwargs: Any) -> Environment:
    """A new instance of the environment registered as `name`; `kwargs` go to its constructor."""
    try:
        cls = ENVIRONMENTS[name]
    except KeyError:
        raise KeyError(f"unknown environment {name!r} (registered: {sorted(ENVIRONMENTS)})") from None
    try:
        return cls(tokenizer, **kwargs)
    except TypeError as err:
        raise TypeError(f"environment {name!r}: {err}") from err


# Imported last: each module registers its environments with the decorator defined above.
from beam_rl.envs import arithmetic, code, guess_number, reverse_text  # noqa: E402,F401

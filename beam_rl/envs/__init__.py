"""The environment registry: built-in environments register by name; `make_env` builds any kind, a
plug-in's too (an entry point of the `beam_rl.environments` group, or "module:Class"; see plugins.py).

Bundled: `arithmetic`, `arithmetic_easy` (the config a tiny model learns in minutes), `reverse_text`,
`guess_number` (multi-turn), `code` (programs run in a sandbox), `tool_arithmetic` (multi-turn tool
calling), `verifiers` (a verifiers taskset's own rewards).
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


def env_class(kind: str) -> type[Environment]:
    """The class `kind` names. A built-in name wins over an entry point of the same name; "module:Class"
    is always an import path. Raises KeyError for an unknown name, PluginError for a broken plug-in."""
    from beam_rl.envs import plugins  # here: it imports the inference client, which imports this package

    if kind in ENVIRONMENTS:
        return ENVIRONMENTS[kind]
    cls = plugins.load_plugin_class(kind)
    if cls is None:
        hint = " (an import path is written 'package.module:Class')" if "." in kind else ""
        raise KeyError(
            f"unknown environment {kind!r} (registered: {sorted(ENVIRONMENTS)}; "
            f"{plugins.ENTRY_POINT_GROUP} entry points: {sorted(plugins.entry_points())}){hint}"
        )
    return cls


def is_plugin(kind: str) -> bool:
    """Whether `kind` comes from outside beam-rl's own registry."""
    return kind not in ENVIRONMENTS


def make_env(kind: str, tokenizer: Any, *, env_name: str | None = None, **kwargs: Any) -> Environment:
    """A new instance of the environment `kind` names; `kwargs` go to its constructor.

    A plug-in's instance comes wrapped in plugins.PluginEnvironment, named `env_name` (its env entry).
    """
    from beam_rl.envs import plugins

    cls = env_class(kind)
    try:
        env = cls(tokenizer, **kwargs)
    except TypeError as err:
        raise TypeError(f"environment {kind!r}: {err}") from err
    except ValueError:
        raise
    except Exception as exc:
        if not is_plugin(kind):
            raise
        raise plugins.construction_failed(kind, cls, exc) from exc
    if is_plugin(kind):
        return plugins.PluginEnvironment(env, env_name or kind, kind)
    if env_name is not None:
        env.name = env_name  # the instance answers to its env entry's name (errors, metrics)
    return env


# Imported last: each module registers its environments with the decorator defined above.
from beam_rl.envs import arithmetic, code, guess_number, reverse_text, tool_use, verifiers_env  # noqa: E402,F401

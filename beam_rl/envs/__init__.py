"""The environment registry: built-in environments register by name; `make_env` builds any kind, a
plug-in's too (an entry point of the `beam_rl.environments` group, or "module:Class"; see plugins.py).

Bundled: `arithmetic`, `arithmetic_easy` (the config a tiny model learns in minutes), `reverse_text`,
`guess_number` (multi-turn), `code` (programs run in a sandbox), `tool_arithmetic` (multi-turn tool
calling), `verifiers` (a verifiers taskset's own rewards), `agent` (any program sampling through an OpenAI
client, by way of the inference proxy).
"""

from __future__ import annotations

from typing import Any

# Each bundled module registers its environments as it is imported.
from beam_rl.envs import (  # noqa: F401
    agent,
    arithmetic,
    code,
    guess_number,
    plugins,
    registry,
    reverse_text,
    tool_use,
    verifiers_env,
)
from beam_rl.envs.base import Environment
from beam_rl.envs.registry import ENVIRONMENTS, register_env

__all__ = ["ENVIRONMENTS", "env_class", "is_plugin", "make_env", "register_env"]


def env_class(kind: str) -> type[Environment]:
    """The class `kind` names. A built-in name wins over an entry point of the same name; "module:Class"
    is always an import path. Raises KeyError for an unknown name, PluginError for a broken plug-in."""
    if kind in registry.ENVIRONMENTS:
        return registry.ENVIRONMENTS[kind]
    cls = plugins.load_plugin_class(kind)
    if cls is None:
        hint = " (an import path is written 'package.module:Class')" if "." in kind else ""
        raise KeyError(
            f"unknown environment {kind!r} (registered: {sorted(registry.ENVIRONMENTS)}; "
            f"{plugins.ENTRY_POINT_GROUP} entry points: {sorted(plugins.entry_points())}){hint}"
        )
    return cls


def is_plugin(kind: str) -> bool:
    """Whether `kind` comes from outside beam-rl's own registry."""
    return kind not in registry.ENVIRONMENTS


def make_env(kind: str, tokenizer: Any, *, env_name: str | None = None, **kwargs: Any) -> Environment:
    """A new instance of the environment `kind` names; `kwargs` go to its constructor.

    A plug-in's instance comes wrapped in plugins.PluginEnvironment, named `env_name` (its env entry).
    """
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

"""Plug-in environments: found by import path or entry point, checked before the run, guarded during it, and
an installed example package found through its entry point (run whole on Prism: tests/pipeline/test_plugin_runs.py)."""

from __future__ import annotations

import asyncio
import itertools
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from beam_rl import wiring
from beam_rl.cli import preflight
from beam_rl.config import ConfigError, config_from_dict
from beam_rl.envs import make_env
from beam_rl.envs.arithmetic import Arithmetic
from beam_rl.envs.base import Completion, SamplingParams, Trajectory
from beam_rl.envs.plugins import PluginEnvironment, PluginError, PluginFailure
from beam_rl.inference.client import InferenceTimeout
from beam_rl.scoring.rewards import assign_rewards
from beam_rl.types import Rollout, RolloutStatus, Turn
from tests.support.paths import REPO

EXAMPLE = REPO / "examples" / "beam-rl-example-env"
_names = itertools.count()

# A plug-in whose behaviour each test picks through its row: {"mode": ...}.
PLUGIN = '''
import json

from beam_rl.envs.base import Environment, Trajectory, RewardUnavailable
from beam_rl.types import Turn


class Toy(Environment):
    name = "toy"

    def load_rows(self, split="train"):
        return [{"mode": "ok"}, {"mode": "ok"}]

    def render_prompt(self, row):
        if row["mode"] == "batch_encoding":
            return {"input_ids": [1, 2]}
        if row["mode"] == "render_raises":
            raise KeyError("question")
        return [1, 2, 3]

    async def run(self, client, row, prompt_ids, sampling):
        mode = row["mode"]
        if mode == "run_raises":
            return {}["missing"]
        if mode == "library_raises":
            return json.loads("{")
        if mode == "client_fails":
            await client.complete(prompt_ids, sampling)
        if mode == "not_trajectory":
            return [[4, 5]]
        if mode == "bad_ids":
            return Trajectory([Turn(["4"], [0.0])])
        if mode == "bad_info":
            return Trajectory([Turn([4], [0.0])], {"when": object()})
        return Trajectory([Turn([4, 5], [-0.1, -0.2])], {"length": 2})

    def reward(self, row, trajectory):
        mode = row["mode"]
        if mode == "reward_raises":
            return 1 / 0
        if mode == "reward_unavailable":
            raise RewardUnavailable("grader down")
        if mode == "reward_text":
            return "1.0"
        if mode == "reward_nan":
            return float("nan")
        if mode == "reward_async":
            return self._later(trajectory)
        return float(trajectory.info["length"])

    async def _later(self, trajectory):
        return trajectory.info["length"] * 10
'''


def write_module(directory: Path, source: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh importable module holding `source`; returns its name."""
    name = f"plugin_{next(_names)}"
    (directory / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(directory))
    return name


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tok: Any) -> PluginEnvironment:
    module = write_module(tmp_path, PLUGIN, monkeypatch)
    env = make_env(f"{module}:Toy", tok, env_name="toys")
    assert isinstance(env, PluginEnvironment)
    return env


class FailingClient:
    async def complete(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[Completion]:
        raise InferenceTimeout("http://127.0.0.1:1: no answer in 1 s", "http://127.0.0.1:1")


def run(env: PluginEnvironment, mode: str) -> Trajectory:
    return asyncio.run(env.run(FailingClient(), {"mode": mode}, [1, 2, 3], SamplingParams()))


# --- Finding the class ------------------------------------------------------------------------------


def test_an_import_path_names_the_class_and_the_instance_answers_to_its_entry(toy: PluginEnvironment) -> None:
    assert type(toy.inner).__name__ == "Toy" and toy.name == "toys"
    assert toy.load_rows("train") == [{"mode": "ok"}, {"mode": "ok"}]
    trajectory = run(toy, "ok")
    assert trajectory.info == {"length": 2} and toy.reward({"mode": "ok"}, trajectory) == 2.0


def test_name_alone_is_a_built_in_kind_and_kind_lets_one_class_run_under_two_names(tok: Any) -> None:
    config = config_from_dict({
        "envs": [{"name": "arithmetic", "group_size": 8},
                 {"name": "hard_sums", "kind": "arithmetic", "group_size": 8, "args": {"max_level": 2}}],
    })
    envs = wiring.build_envs(config)
    assert [type(e) for e in envs.values()] == [Arithmetic, Arithmetic]
    assert (envs["arithmetic"].name, envs["hard_sums"].name) == ("arithmetic", "hard_sums")
    assert envs["hard_sums"].max_level == 2


@pytest.mark.parametrize(
    ("source", "kind", "error"),
    [
        ("import not_a_module_anywhere\n", "{m}:Env",
         r"kind '{m}:Env': importing '{m}' failed: ModuleNotFoundError: No module named 'not_a_module_anywhere' "
         r"\(at .*{m}\.py:1 in <module>\)"),
        ("def broken(:\n", "{m}:Env", r"importing '{m}' failed: SyntaxError: .*\(at .*{m}\.py:1\)"),
        ("X = 1\n", "{m}:Env", r"module '{m}' has no attribute 'Env'"),
        ("def Env(tokenizer): pass\n", "{m}:Env", r"names <function Env .*>, which is not a class"),
        ("class Env: pass\n", "{m}:Env", r"{m}\.Env is not a subclass of beam_rl\.envs\.base\.Environment"),
        ("from beam_rl.envs.base import Environment\n"
         "class Env(Environment):\n    def load_rows(self, split): return []\n",
         "{m}:Env", r"{m}\.Env does not implement render_prompt, reward"),
        (PLUGIN + "\nclass Env(Toy):\n    def run(self, client, row, prompt_ids, sampling): pass\n",
         "{m}:Env", r"{m}\.Env\.run must be `async def`"),
        ("", "{m}", r"unknown environment '{m}' \(registered: \['agent', 'arithmetic'.*; beam_rl\.environments entry points: "),
        ("", "{m}.Env", r"unknown environment '{m}\.Env' .*an import path is written 'package\.module:Class'"),
    ],
)
def test_a_broken_plugin_is_named_before_the_run_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tok: Any, source: str, kind: str, error: str
) -> None:
    module = write_module(tmp_path, source, monkeypatch)
    kind, error = kind.format(m=module), error.format(m=re.escape(module))
    with pytest.raises((PluginError, KeyError), match=error):
        make_env(kind, tok)


def test_preflight_reports_a_broken_plugin_as_a_config_error_on_its_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = write_module(tmp_path, "raise RuntimeError('needs a GPU')\n", monkeypatch)
    config = config_from_dict({"run": {"dir": str(tmp_path / "run")},
                               "envs": [{"name": "mine", "kind": f"{module}:Env"}]})
    with pytest.raises(ConfigError) as caught:
        preflight(config, "run.toml")
    ((key, message),) = caught.value.problems
    assert key == "envs[0].kind"
    location = f"{tmp_path / module}.py:1 in <module>"
    assert f"importing '{module}' failed: RuntimeError: needs a GPU (at {location})" in message
    assert not (tmp_path / "run").exists()  # nothing written before the config is known to work


def test_a_constructor_that_raises_is_named_with_its_location(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tok: Any
) -> None:
    module = write_module(tmp_path, PLUGIN + "\nclass Env(Toy):\n    def __init__(self, tokenizer, **kw):\n"
                          "        open('/nonexistent/weights.bin')\n", monkeypatch)
    with pytest.raises(PluginError, match=rf"constructing {module}\.Env raised FileNotFoundError: .* "
                                          rf"\(at .*{module}\.py:\d+ in __init__\)"):
        make_env(f"{module}:Env", tok)


# --- Guarding the calls -----------------------------------------------------------------------------


def test_render_prompt_must_return_token_ids(toy: PluginEnvironment) -> None:
    assert toy.render_prompt({"mode": "ok"}) == [1, 2, 3]
    with pytest.raises(PluginFailure, match=r"env 'toys' \(plug-in 'plugin_\d+:Toy'\): render_prompt returned "
                                            r"\{'input_ids': \[1, 2\]\}, not a list of token ids \(transformers 5's "
                                            r".*chat_prompt_ids gives the list\); row \{'mode': 'batch_encoding'\}"):
        toy.render_prompt({"mode": "batch_encoding"})
    with pytest.raises(PluginFailure, match=r"render_prompt raised KeyError: 'question' \(at .*plugin_\d+\.py:\d+ "
                                            r"in render_prompt\); row \{'mode': 'render_raises'\}"):
        toy.render_prompt({"mode": "render_raises"})


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("run_raises",
         r"run raised KeyError: 'missing' \(at .*plugin_\d+\.py:\d+ in run\); row \{'mode': 'run_raises'\}"),
        # Raised inside the json module, located at the plug-in's line that called it.
        ("library_raises", r"run raised JSONDecodeError: .* \(at [^ ]*plugin_\d+\.py:\d+ in run\); row"),
        ("not_trajectory", r"run returned \[\[4, 5\]\], not a beam_rl\.envs\.base\.Trajectory; row"),
        ("bad_ids", r"run returned turn 0 with completion_ids \['4'\], not a list of ints"),
        ("bad_info", r"run returned info that is not JSON-able \(Object of type object is not JSON serializable\)"),
    ],
)
def test_run_is_checked_where_it_returns(toy: PluginEnvironment, mode: str, error: str) -> None:
    with pytest.raises(PluginFailure, match=r"env 'toys' \(plug-in 'plugin_\d+:Toy'\): " + error):
        run(toy, mode)


def test_server_errors_pass_through_unchanged_so_the_server_is_blamed(toy: PluginEnvironment) -> None:
    with pytest.raises(InferenceTimeout) as caught:
        run(toy, "client_fails")
    assert caught.value.server_fault


def _rollouts(*modes: str) -> list[Rollout]:
    return [Rollout("e0-i0", "toys", i, len(modes), prompt_ids=[1], turns=[Turn([4, 5], [-0.1, -0.2])],
                    info={"length": 2}, row={"mode": mode}) for i, mode in enumerate(modes)]


def test_rewards_plain_async_and_unavailable_go_through_the_scoring_stage(toy: PluginEnvironment) -> None:
    rollouts = _rollouts("ok", "reward_async", "reward_unavailable")
    assign_rewards(rollouts, toy)
    assert [r.reward for r in rollouts[:2]] == [2.0, 20.0] and rollouts[0].ok and rollouts[1].ok
    assert rollouts[2].status is RolloutStatus.REWARD_ERROR and rollouts[2].errors == ["RewardUnavailable: grader down"]


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("reward_raises", r"reward raised ZeroDivisionError: division by zero \(at .*plugin_\d+\.py:\d+ in reward\)"),
        ("reward_text", r"reward returned '1\.0' \(str\), not a finite number"),
        ("reward_nan", r"reward returned nan \(float\), not a finite number"),
    ],
)
def test_a_broken_reward_stops_scoring_with_the_env_the_plugin_and_the_row(
    toy: PluginEnvironment, mode: str, error: str
) -> None:
    # Not RewardUnavailable: a reward that is wrong must not quietly become a masked rollout.
    expected = rf"env 'toys' \(plug-in 'plugin_\d+:Toy'\): {error}; row \{{'mode': '{mode}'\}}"
    with pytest.raises(PluginFailure, match=expected):
        assign_rewards(_rollouts(mode), toy)


# --- An installed package, end to end ---------------------------------------------------------------


@pytest.fixture(scope="module")
def example_installed(tmp_path_factory: pytest.TempPathFactory):
    """The example package pip-installed (offline) into a temporary --target directory on sys.path."""
    work = tmp_path_factory.mktemp("example-env")
    source = work / "src"
    shutil.copytree(EXAMPLE, source)  # the build writes build/ and *.egg-info beside its sources
    target = work / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(source)],
        check=True, timeout=300,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(target))
        yield target
    for module in [m for m in sys.modules if m.startswith("beam_rl_example_env")]:
        del sys.modules[module]


def test_an_installed_package_is_found_through_its_entry_point(example_installed: Path, tok: Any) -> None:
    env = make_env("letter_words", tok, env_name="letters")
    assert isinstance(env, PluginEnvironment) and type(env.inner).__module__ == "beam_rl_example_env.letter_words"
    assert env.load_rows("train")[0] == {"letter": "m", "count": 2} and len(env.load_rows("eval")) == 8
    trajectory = Trajectory([Turn(tok.encode("mom, moon and sun"), [0.0] * 5)])
    assert asyncio.run(env.reward({"letter": "m", "count": 2}, trajectory)) == 1.0

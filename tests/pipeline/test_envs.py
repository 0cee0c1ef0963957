"""Environments run whole through the rollout pipeline on Prism: an installed plug-in package (every rollout
trained once with its own reward), a plug-in reward that breaks (the run stops with a typed failure record), and a
black-box agent (the rank files hold the tokens it sampled). Their rules on their own: tests/unit/envs/."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from beam_rl.config import config_from_dict
from beam_rl.envs import make_env
from beam_rl.model.tokenizer import load_tokenizer
from tests.unit.envs.test_plugins import PLUGIN, example_installed, write_module  # noqa: F401 (a fixture)
from tests.unit.envs.test_proxy import AGENT, dataset  # noqa: F401 (a fixture)


@pytest.mark.timeout(300)
def test_an_installed_plugin_runs_end_to_end_through_the_pipeline(example_installed: Path, tmp_path: Path) -> None:
    from beam_rl_example_env.letter_words import score

    from beam_rl.rundir import RunDir
    from beam_rl.standin.server import EmbeddedServer
    from beam_rl.model.tiny import tiny_model_dir
    from beam_rl.job.rollouts import run_rollouts

    config = config_from_dict({
        "run": {"dir": str(tmp_path / "run"), "max_steps": 10},
        "envs": [{"name": "letters", "kind": "letter_words", "group_size": 4}],
        "batch": {"rollouts_per_step": 32},
        "inference": {"max_tokens": 12, "max_inflight": 16},
        "filters": {"zero_advantage": {"mode": "off"}},  # train every rollout, so each one's reward is checked
    })
    server = EmbeddedServer(model_dir=tiny_model_dir(), served_model_name="tiny", max_num_seqs=32)
    try:
        run_rollouts(config, [server.start()], with_trainer=False)
    finally:
        server.stop()

    run_dir = RunDir(tmp_path / "run")
    rows = make_env("letter_words", load_tokenizer("tiny")).load_rows("train")
    steps = run_dir.committed_steps()
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 4
    windows = [run_dir.read_window(step).to_pylist() for step in steps]
    window = [r for w in windows for r in w]
    assert len(window) == len(rows) * 4 and {r["env"] for r in window} == {"letters"}
    assert all(r["status"] == "ok" for r in window), [r["errors"] for r in window if r["status"] != "ok"]
    tok = load_tokenizer("tiny")
    row_index = {r["rollout_id"]: r["index"] for r in window}
    checked = []
    for step in steps:
        table = pa.ipc.open_file(pa.memory_map(str(run_dir.rank_path(step, 0)))).read_all().to_pylist()
        for sample in table:
            index = row_index[sample["rollout_id"]]
            completion = [t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m]
            text = tok.decode(completion[: completion.index(tok.eos_token_id)] if tok.eos_token_id in completion
                              else completion, skip_special_tokens=True)
            assert math.isclose(sample["reward"], score(text, rows[index]["letter"], rows[index]["count"]),
                                rel_tol=1e-6), (sample["rollout_id"], text)
            checked.append(sample["rollout_id"])
    assert len(checked) == len(set(checked)) == len(window)  # every rollout trained once, with its own reward
    assert {r["reward"] for r in window} != {0.0}  # the random policy earns some reward: rewards really vary


@pytest.mark.timeout(300)
def test_a_reward_that_breaks_stops_the_run_with_a_typed_failure_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from beam_rl.rundir.failures import read_failure
    from beam_rl.standin.server import EmbeddedServer
    from beam_rl.job.rollouts import run_rollouts

    module = write_module(tmp_path, PLUGIN + "\nclass Env(Toy):\n    def load_rows(self, split='train'):\n"
                          "        return [{'mode': 'reward_text'}] * 4\n", monkeypatch)
    config = config_from_dict({
        "run": {"dir": str(tmp_path / "run")}, "envs": [{"name": "broken", "kind": f"{module}:Env", "group_size": 2}],
        "batch": {"rollouts_per_step": 4}, "inference": {"max_tokens": 4, "max_inflight": 8},
    })
    started = time.time()
    with EmbeddedServer(mode="instant") as server, pytest.raises(Exception, match="PluginFailure"):
        run_rollouts(config, [server.url], with_trainer=False)
    failure = read_failure(tmp_path / "run", since=started)
    assert failure is not None and (failure.error, failure.stage) == ("PluginFailure", "score")
    assert "reward returned" in failure.message and "not a finite number" in failure.message


@pytest.mark.timeout(180)
def test_an_agent_trains_on_prism_and_the_rank_files_hold_the_tokens_it_sampled(tok, tmp_path, dataset):
    """The black-box agent in the rollout pipeline (Prism; its LOOPBACK worker runs the dispatcher here):
    each sample of the rank files is the agent's first prompt, its completions and the tool message's
    template ids between them, and only the completions are trained."""
    from beam_rl.config import config_from_dict
    from beam_rl.rundir import RunDir
    from beam_rl.standin.server import EmbeddedServer
    from beam_rl.job.rollouts import run_rollouts
    from tests.support.run_checks import assert_rank_files_hold_the_windows_tokens

    (dataset / "train.jsonl").write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(8)))
    config = config_from_dict({
        "run": {"dir": str(tmp_path / "run"), "max_steps": 100},
        "envs": [{"name": "agent", "group_size": 2, "max_turns": 2, "mode": "rollout",
                  "args": {"command": [sys.executable, str(AGENT)], "dataset": str(dataset)}}],
        "batch": {"rollouts_per_step": 4},
        "filters": {"zero_advantage": {"mode": "monitor"}},
        "inference": {"max_tokens": 8, "max_inflight": 8},
        "runner": {"name": "direct"},
    })
    server = EmbeddedServer(mode="instant", served_model_name="tiny", max_num_seqs=16)
    try:
        run_rollouts(config, [server.start()], with_trainer=False)
    finally:
        server.stop()

    rollouts = assert_rank_files_hold_the_windows_tokens(RunDir(tmp_path / "run"))
    assert len(rollouts) == 16
    assert all(len(r["turns"]) == 2 and r["turns"][1]["env_ids"] for r in rollouts)  # the tool message between

"""A run that cannot make progress says why and stops (beam_rl/source/status.py): errors by cause in the
status files, merged over shards and shown live; the progress watch's two rules at their defaults; the
config checked against the model's context; and the CLI's seams (one argument shape for `run` and
`rollouts`, help for every option, agent errors naming the agent). The whole run that stops and resumes is
in tests/pipeline/test_user_failures.py."""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import time

import pytest
from rich.console import Console

from beam_rl.wiring import job_parts
from beam_rl import cli
from beam_rl.job.preflight import check_servers, model_problems, refuse
from beam_rl.config import ConfigError, RunSection, config_from_dict, load_config
from beam_rl.envs import make_env
from beam_rl.envs.agent import AgentError
from beam_rl.inference.types import SamplingParams
from beam_rl.observe import RunObserver
from beam_rl.processes import free_port
from beam_rl.rundir import RunDir
from beam_rl.rundir.failures import ServersNotReadyError
from beam_rl.source.status import ErrorTally, NothingTrainsError, ProgressWatch, error_cause
from beam_rl.standin.server import EmbeddedServer
from beam_rl.model.tiny import tiny_model_dir
from beam_rl.model.tokenizer import load_tokenizer
from beam_rl.types import Rollout, RolloutStatus
from beam_rl.job import live
from tests.support.observe_run import observe_config
from tests.unit.observe.test_prometheus import scrape, value

HTTP_400 = ("InferenceHTTPError: POST http://127.0.0.1:8000/v1/completions: HTTP 400: This model's maximum context "
            "length is 1024 tokens. However, you requested 1208 tokens")


def errored(group: str, index: int, error: str, env: str = "vf") -> Rollout:
    rollout = Rollout(group_id=group, env_name=env, attempt=0, group_size=1, index=index)
    rollout.capture_error(error)
    return rollout


def ok(group: str) -> Rollout:
    return Rollout(group_id=group, env_name="vf", attempt=0, group_size=1)


def test_errors_are_counted_by_cause_with_the_newest_example_naming_env_and_row():
    tally = ErrorTally()
    for i in range(3):
        tally.note(errored(f"g{i}", i, HTTP_400), now=100.0 + i)
    tally.note(errored("g9", 9, "AgentError: agent `python agent.py`: exited with status 3\nTraceback"), now=99.0)
    assert error_cause(HTTP_400) == "InferenceHTTPError (HTTP 400)"
    [newest, older] = tally.as_status()
    assert newest == {"cause": "InferenceHTTPError (HTTP 400)", "count": 3, "last_at": 102.0,
                      "example": f"env 'vf' row 2 (epoch 0): {HTTP_400}"}
    assert older["cause"] == "AgentError" and older["example"].endswith("exited with status 3 Traceback")  # one line
    assert tally.most_frequent() == ("InferenceHTTPError (HTTP 400), 3 of 4 errored rollouts; the newest: "
                                     f"env 'vf' row 2 (epoch 0): {HTTP_400}")


def test_the_status_of_several_shards_sums_each_cause_and_keeps_the_newest_example(tmp_path):
    run = RunDir(tmp_path)
    run.write_status({"errors": [{"cause": "A", "count": 2, "example": "a0", "last_at": 5.0},
                                 {"cause": "B", "count": 1, "example": "b0", "last_at": 1.0}]}, shard=0)
    run.write_status({"errors": [{"cause": "B", "count": 4, "example": "b1", "last_at": 9.0}]}, shard=1)
    assert run.read_status()["errors"] == [{"cause": "B", "count": 5, "example": "b1", "last_at": 9.0},
                                           {"cause": "A", "count": 2, "example": "a0", "last_at": 5.0}]


def test_the_live_view_shows_the_newest_causes_under_the_table(tmp_path):
    run = RunDir(tmp_path)
    tally = ErrorTally()
    tally.note(errored("g0", 7, HTTP_400), now=1.0)
    run.write_status({"inflight": 16, "errored": 8, "errors": tally.as_status(), "servers": []})
    config = load_config("configs/tiny.toml")
    console = Console(file=io.StringIO(), width=400, color_system=None)
    observer = RunObserver(run, config)
    try:
        console.print(live.ProgressView(run, config, time.monotonic(), observer, console).render())
    finally:
        observer.close()
    assert console.file.getvalue().splitlines()[-1] == ("1 errored: InferenceHTTPError (HTTP 400); the newest: "
                                                        f"env 'vf' row 7 (epoch 0): {HTTP_400}")


def test_prometheus_counts_errored_rollouts_by_cause(tmp_path):
    run = RunDir(tmp_path)
    tally = ErrorTally()
    for i in range(3):
        tally.note(errored(f"g{i}", i, HTTP_400), now=1.0)
    tally.note(errored("g3", 3, "PromptTooLong: the prompt is 318 tokens"), now=2.0)
    run.write_status({"errored": 4, "errors": tally.as_status()})
    port = free_port()
    with RunObserver(run, observe_config(prometheus_port=port, prometheus_host="127.0.0.1")) as observer:
        observer.poll()
        samples = scrape(port)
    assert value(samples, "beam_rl_rollout_errors_total", cause="InferenceHTTPError (HTTP 400)") == 3
    assert value(samples, "beam_rl_rollout_errors_total", cause="PromptTooLong") == 1


def _watch(tally: ErrorTally) -> ProgressWatch:
    defaults = RunSection()  # the defaults users run
    return ProgressWatch(defaults.stop_after_errored_groups, defaults.stop_after_failing_s, tally, now=0.0)


def test_every_rollout_of_16_groups_in_a_row_errored_stops_the_run_and_a_group_with_an_ok_rollout_resets_the_count():
    tally = ErrorTally()
    watch = _watch(tally)
    for i in range(15):
        tally.note(errored(f"g{i}", i, HTTP_400), now=float(i))
        watch.group_returned(all_errored=True)
    watch.group_returned(all_errored=False)
    watch.check(1.0, last_committed=0, waiting_for_trainer=False)
    for _ in range(15):
        watch.group_returned(all_errored=True)
    watch.check(2.0, last_committed=0, waiting_for_trainer=False)  # 15 in a row: not yet
    watch.group_returned(all_errored=True)
    assert watch.too_many_errored_groups
    with pytest.raises(NothingTrainsError) as stopped:
        watch.check(3.0, last_committed=0, waiting_for_trainer=False)
    assert str(stopped.value).startswith("nothing can train: every rollout of the last 16 groups errored "
                                         "(run.stop_after_errored_groups = 16); most frequent cause: "
                                         "InferenceHTTPError (HTTP 400), 15 of 15 errored rollouts; the newest: "
                                         "env 'vf' row 14 (epoch 0): ")


def test_no_step_for_600_s_while_half_the_rollouts_fail_stops_the_run_and_a_commit_or_the_trainer_restarts_the_clock():
    tally = ErrorTally()
    watch = _watch(tally)
    watch.check(0.0, last_committed=0, waiting_for_trainer=False)

    def finish(*rollouts: Rollout) -> None:
        for rollout in rollouts:
            if rollout.status is RolloutStatus.ERROR:
                tally.note(rollout, now=0.0)
            watch.rollout_finished(rollout)

    finish(errored("g0", 0, HTTP_400), errored("g0", 0, HTTP_400), ok("g0"))  # 2 of 3 errored, no group all errored
    watch.check(600.0, last_committed=0, waiting_for_trainer=False)  # not past 600 s
    watch.check(601.0, last_committed=1, waiting_for_trainer=False)  # a step: the clock starts again
    finish(errored("g1", 1, HTTP_400))
    watch.check(1100.0, last_committed=1, waiting_for_trainer=True)  # the trainer is what it waits for
    finish(errored("g2", 2, HTTP_400), ok("g2"), ok("g2"))  # most succeed: the filters' business, not an error
    watch.check(1800.0, last_committed=1, waiting_for_trainer=False)
    finish(errored("g3", 3, HTTP_400))  # now half of them errored
    with pytest.raises(NothingTrainsError, match=r"^nothing can train: no step committed in 700s while 2 of the 4 "
                                                 r"rollouts finished errored \(run.stop_after_failing_s = 600\); most "
                                                 r"frequent cause: InferenceHTTPError \(HTTP 400\), 5 of 5 "):
        watch.check(1800.0, last_committed=1, waiting_for_trainer=False)


def _tiny_config(max_context: int, **inference) -> dict:
    return {"model": {"max_context": max_context}, "batch": {"seq_len": max(1024, max_context)},
            "inference": inference, "envs": [{"name": "reverse_text"}]}


def test_a_max_context_above_the_models_is_an_error_naming_the_key_before_anything_starts():
    config = config_from_dict(_tiny_config(2048, max_tokens=1500))
    with pytest.raises(ConfigError) as caught:
        refuse(model_problems(config), "run.toml")
    where = f"max_position_embeddings = 1024 in {tiny_model_dir(0) / 'config.json'}"
    assert caught.value.problems == [("model.max_context", f"2048 is above the model's context: {where}"),
                                     ("inference.max_tokens", f"1500 is above the model's context: {where}")]
    refuse(model_problems(config_from_dict(_tiny_config(1024))), "run.toml")  # the whole context is fine


def test_a_server_whose_context_is_below_max_context_is_refused_at_start_up():
    with EmbeddedServer(mode="instant") as server:
        config = config_from_dict({**_tiny_config(2048), "inference": {"urls": [server.url]}})
        with pytest.raises(ServersNotReadyError, match=rf"{server.url} serves a context of 1024 tokens \(max_model_len "
                                                       r"in /v1/models\): model.max_context = 2048 is above it"):
            check_servers(job_parts(config), [server.url])
        check_servers(job_parts(config_from_dict({**_tiny_config(1024), "inference": {"urls": [server.url]}})),
                                 [server.url])


def _actions(parser: argparse.ArgumentParser, path: str = "beam-rl"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_and_argument_of_every_command_has_help():
    missing = [f"{path} {action.option_strings or action.dest}" for path, action in _actions(cli.build_parser())
               if not action.help]
    assert missing == []


@pytest.mark.parametrize("command", ["run", "rollouts"])
def test_run_and_rollouts_take_config_the_same_way_and_the_old_option_still_works(command):
    parser = cli.build_parser()
    for argv in ([command, "a.toml"], [command, "--config", "a.toml"], [command, "a.toml", "--config", "a.toml"]):
        assert cli._given_config(parser.parse_args(argv)) == "a.toml"
    assert parser.parse_args([command, "a.toml", "--run-dir", "r"]).run_dir == "r"
    with pytest.raises(ConfigError, match="a second config is given with --config: b.toml"):
        cli._given_config(parser.parse_args([command, "a.toml", "--config", "b.toml"]))


def test_an_agents_error_names_its_command_line_not_the_interpreter(tmp_path):
    script = tmp_path / "my_agent.py"
    script.write_text("import sys; sys.exit(3)")
    dataset = tmp_path / "data"
    dataset.mkdir()
    (dataset / "train.jsonl").write_text('{"prompt": "hi"}\n')
    tok = load_tokenizer("tiny")
    env = make_env("agent", tok, command=[sys.executable, str(script), "--fast"], dataset=str(dataset))
    row = env.load_rows("train")[0]
    with pytest.raises(AgentError) as caught:
        asyncio.run(env.run(None, row, env.render_prompt(row), SamplingParams()))
    assert str(caught.value) == f"agent `{sys.executable} {script} --fast`: exited with status 3"

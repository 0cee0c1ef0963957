"""The LLM judge against the embedded server's chat completions: its scripted replies are the judge's
answers, each with its own latency, and its faults are the judge's failures."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from typing import Any

import pytest

from beam_rl.config import JudgeSection, config_from_dict
from beam_rl.envs import make_env
from beam_rl.envs.base import RewardUnavailable
from beam_rl.scoring.judge import Judge, JudgeError, answer_text
from beam_rl.scoring.rewards import EnvReward, Rewarder, RewardLoop
from beam_rl.standin.faults import FaultInjector
from beam_rl.standin.server import EmbeddedServer, FaultConfig
from beam_rl.model.tokenizer import load_tokenizer
from beam_rl.types import Rollout, RolloutStatus, Turn
from tests.support.paths import REPO

SECRET = "sk-judge-7f3a9c-never-print-me"


def _judge(url: str, **overrides: Any) -> Judge:
    config = {"url": url, "model": "judge", "prompt": "Q: {question}\nA: {completion}",
              "verdict": {"pattern": r"SCORE:\s*(\S+)"}, "retry_backoff_s": 0.0, **overrides}
    return Judge(JudgeSection.model_validate(config), "arith")


def _grade(judge: Judge, completion: str = "4") -> float:
    async def once() -> float:
        try:
            return await judge.grade({"question": "2 + 2"}, completion)
        finally:
            await judge.aclose()
    return asyncio.run(once())


@pytest.fixture
def server(start_embedded):
    def start(**faults: Any) -> EmbeddedServer:
        api_key, name = faults.pop("api_key", None), faults.pop("served_model_name", None)
        return start_embedded(mode="instant", faults=FaultConfig(**faults), api_key=api_key, served_model_name=name)

    return start


def _seed_for(draws: list[str | None], **rates: float) -> int:
    """A fault seed whose first requests draw exactly `draws` (the server's own injector decides)."""
    for seed in range(1000):
        injector = FaultInjector(FaultConfig(seed=seed, **rates))
        if [injector.draw() for _ in draws] == draws:
            return seed
    raise AssertionError(f"no seed draws {draws}")


# -- the request and the verdict --------------------------------------------------------------


def test_messages_fill_the_prompt_with_the_rows_fields_and_the_completion() -> None:
    judge = _judge("http://127.0.0.1:9", system="You grade arithmetic.")
    assert judge.messages({"question": "2 + 2", "answer": "4"}, "four") == [
        {"role": "system", "content": "You grade arithmetic."}, {"role": "user", "content": "Q: 2 + 2\nA: four"}]
    with pytest.raises(JudgeError, match=r"env 'arith': reward.judge.prompt names \{question\}, which the row "
                                         r"lacks \(its fields: \['text'\]\)"):
        judge.messages({"text": "abc"}, "cba")


def test_the_last_verdict_counts_as_a_number_or_through_labels() -> None:
    judge = _judge("http://127.0.0.1:9")
    assert judge.verdict("SCORE: 3 at first, but on reflection SCORE: 7.5") == 7.5
    labelled = _judge("http://127.0.0.1:9", verdict={"pattern": r"VERDICT:\s*(\w+)",
                                                     "labels": {"Correct": 1.0, "wrong": -0.5}})
    assert labelled.verdict("VERDICT: correct") == 1.0 and labelled.verdict("VERDICT: WRONG") == -0.5
    with pytest.raises(RewardUnavailable, match=r"judge verdict 'maybe' is none of the labels \['correct', 'wrong'\]"):
        labelled.verdict("VERDICT: maybe")


def test_an_unparseable_verdict_is_unavailable_quoting_the_answer_cut_short() -> None:
    judge = _judge("http://127.0.0.1:9")
    rambling = "I think the answer is fine " * 20
    with pytest.raises(RewardUnavailable) as caught:
        judge.verdict(rambling)
    message = str(caught.value)
    assert message.startswith(r"judge answer has no verdict matching 'SCORE:\\s*(\\S+)': 'I think the answer")
    assert message.endswith("...'") and len(message) < 300
    for answer in ("SCORE: seven", "SCORE: nan", "SCORE: inf"):
        with pytest.raises(RewardUnavailable, match="is not a finite number"):
            judge.verdict(answer)


def test_the_commented_judge_example_of_tiny_toml_is_a_valid_config(monkeypatch) -> None:
    monkeypatch.setenv("JUDGE_API_KEY", "sk-example")
    text = (REPO / "configs" / "tiny.toml").read_text()
    block = text[text.index("# [envs.reward.judge]"):text.index("[batch]")]
    uncommented = "\n".join(re.sub(r"^# ?", "", line) for line in block.splitlines() if line.startswith("#"))
    import tomllib

    judge = tomllib.loads(uncommented)["envs"]["reward"]["judge"]
    config = config_from_dict({"envs": [{"name": "arithmetic", "reward": {"judge": judge}}]})
    assert _judge_of(config).verdict("so SCORE: 8") == 8.0


def _judge_of(config) -> Judge:
    return Judge(config.envs[0].reward.judge, config.envs[0].name)


# -- against a server -----------------------------------------------------------------------


def test_a_judge_grades_through_chat_completions(server) -> None:
    s = server(replies=["Fine work. SCORE: 9", "I would rather not say", "SCORE: ???"])
    judge = _judge(s.url)
    assert _grade(judge) == 9.0
    with pytest.raises(RewardUnavailable, match=r"no verdict matching .*: 'I would rather not say'"):
        _grade(judge)
    with pytest.raises(RewardUnavailable, match=r"judge verdict '\?\?\?' is not a finite number: 'SCORE: \?\?\?'"):
        _grade(judge)
    assert s.requests_total == 3  # an answer that does not parse is not asked again


def test_a_judge_that_takes_too_long_is_unavailable(server) -> None:
    s = server(replies=[{"text": "SCORE: 1", "latency_s": 5.0}])
    started = time.perf_counter()
    with pytest.raises(RewardUnavailable, match=rf"judge {s.url}/v1/chat/completions timed out after 0.3 s"):
        _grade(_judge(s.url, timeout_s=0.3))
    assert time.perf_counter() - started < 3


def test_server_errors_are_retried_then_the_answer_counts(server) -> None:
    seed = _seed_for(["error", "error", None], error_rate=0.5)
    s = server(replies=["SCORE: 6"], error_rate=0.5, seed=seed)
    assert _grade(_judge(s.url, max_retries=2)) == 6.0
    assert s.requests_total == 3
    s = server(replies=["SCORE: 6"], error_rate=0.5, seed=seed)
    with pytest.raises(RewardUnavailable, match=r"failed 2 time\(s\), last: HTTP 500: 'injected fault"):
        _grade(_judge(s.url, max_retries=1))


def test_dropped_connections_are_retried(server) -> None:
    seed = _seed_for(["drop", None], drop_rate=0.5)
    s = server(replies=["SCORE: 2"], drop_rate=0.5, seed=seed)
    assert _grade(_judge(s.url, max_retries=1)) == 2.0 and s.requests_total == 2
    with socket.socket() as sock:  # a port with nobody listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(RewardUnavailable, match="failed 3 time.*ClientConnectorError"):
        _grade(_judge(f"http://127.0.0.1:{port}", max_retries=2))


def test_a_request_the_judge_cannot_take_is_unavailable_and_a_wrong_model_stops_the_run(server) -> None:
    s = server(replies=["SCORE: 1"], served_model_name="grader")
    with pytest.raises(RewardUnavailable, match=r"answered HTTP 400: \"This model's maximum context length is 1024"):
        _grade(_judge(s.url, model="grader"), completion="word " * 2000)
    with pytest.raises(JudgeError, match=r"refused the request \(HTTP 404: 'The model `judge` does not exist.'\)"):
        _grade(_judge(s.url, model="judge"))
    assert s.requests_total == 2  # neither is retried


def test_an_answer_without_a_chat_message_is_unavailable() -> None:
    for body, shown in [({"choices": []}, "without a chat message"), ("<html>busy</html>", "without a chat message"),
                        ({"choices": [{"message": {"content": None}}]}, "with no text")]:
        with pytest.raises(RewardUnavailable, match=shown):
            answer_text(body)


def test_the_api_key_is_sent_and_never_shown(server, monkeypatch, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    s = server(replies=["SCORE: 5"], api_key=SECRET)
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    judge = _judge(s.url, api_key_env="JUDGE_KEY")
    assert _grade(judge) == 5.0  # the server answers 401 without it
    messages = [repr(judge), str(judge.config)]
    monkeypatch.setenv("JUDGE_KEY", "sk-wrong")
    with pytest.raises(JudgeError, match=r"refused the request \(HTTP 401: 'Unauthorized'\); check") as caught:
        _grade(_judge(s.url, api_key_env="JUDGE_KEY"))
    messages.append(str(caught.value))
    monkeypatch.delenv("JUDGE_KEY")
    with pytest.raises(JudgeError, match="api_key_env names JUDGE_KEY, which is not set"):
        _judge(s.url, api_key_env="JUDGE_KEY")
    assert caplog.records  # every logger's records, DEBUG up, were captured
    for text in [*messages, caplog.text]:
        assert SECRET not in text


def test_a_judge_replaces_an_environments_reward_on_the_reward_loop(server) -> None:
    s = server(replies=["SCORE: 0.25", "SCORE: 1", "nothing to say"])
    tokenizer = load_tokenizer("tiny")
    env = make_env("arithmetic", tokenizer)
    ids = tokenizer.encode("17", add_special_tokens=False) + [tokenizer.eos_token_id]
    rollouts = [Rollout("g", "arith", i, 3, turns=[Turn(ids, [0.0] * len(ids), "stop")],
                        row={"question": "8 + 9", "answer": "17"}) for i in range(3)]
    with RewardLoop() as loop:
        rewarder = Rewarder({"arith": EnvReward(env, judge=_judge(s.url), name="arith")}, loop)
        rewarder.start(rollouts).wait()
        rewarder.close()
    assert sorted(r.reward for r in rollouts if r.ok) == [0.25, 1.0]  # not the env's own 1.0 for both
    (failed,) = [r for r in rollouts if not r.ok]
    assert failed.status is RolloutStatus.REWARD_ERROR and "'nothing to say'" in failed.errors[0]


def test_a_reward_loop_closes_its_judges_sessions_when_it_stops(server) -> None:
    # A cancelled job's workers may never tear their DoFns down: the loop closes the sessions itself.
    s = server(replies=["SCORE: 1"])
    judge = {"url": s.url, "model": "judge", "prompt": "{question} {completion}",
             "verdict": {"pattern": r"SCORE: (\d)"}}
    config = config_from_dict({"envs": [{"name": "arith", "kind": "arithmetic", "group_size": 2,
                                         "reward": {"judge": judge}}]})
    tokenizer = load_tokenizer("tiny")
    rollouts = [Rollout("g", "arith", i, 2, turns=[Turn([5], [0.0], "stop")], row={"question": "1 + 0", "answer": "1"})
                for i in range(2)]
    loop = RewardLoop()
    rewarder = Rewarder.from_config(config, {"arith": make_env("arithmetic", tokenizer)}, loop)
    assert [r.reward for r in rewarder.start(rollouts).wait()] == [1.0, 1.0]
    (session,) = rewarder.rewards["arith"].judge._sessions.values()
    loop.close()
    assert session.closed and loop.closed

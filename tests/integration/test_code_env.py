"""The code environment: its bundled tasks, program extraction, and rewards computed in the real sandbox,
including programs that misbehave (scored as the program's failure) and a sandbox that cannot run
(RewardUnavailable)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from beam_rl.envs import make_env
from beam_rl.envs.base import RewardUnavailable, Trajectory
from beam_rl.envs.code import Code, extract_program, same, split_test
from beam_rl.envs.datasets import DatasetError
from beam_rl.envs.sandbox import SandboxLimits
from beam_rl.scoring.rewards import assign_rewards
from beam_rl.types import Rollout, RolloutStatus, Turn
from tests.support import children

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (scripts/setup.sh)")

FIB_ROW = {
    "task_id": "fibonacci",
    "prompt": 'def fibonacci(n: int) -> int:\n    """The n-th Fibonacci number."""\n',
    "tests": ["assert fibonacci(0) == 0", "assert fibonacci(1) == 1", "assert fibonacci(10) == 55",
              "assert fibonacci(20) == 6765"],
}
FIB = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
# One row for the containment checks: the program must return "sealed" from probe().
PROBE_ROW = {"task_id": "probe", "prompt": "def probe() -> str:\n", "tests": ["assert probe() == 'sealed'"]}


@pytest.fixture(scope="module")
def env(tok: Any) -> Code:
    return make_env("code", tok, wall_s=5, test_timeout_s=1.0)


def answer(tok: Any, text: str) -> Trajectory:
    """A single-turn trajectory whose completion is `text`, ended by EOS."""
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return Trajectory([Turn(ids, [-0.1] * len(ids), "stop")])


def reward(env: Code, tok: Any, row: dict[str, Any], text: str) -> float:
    return asyncio.run(env.reward(row, answer(tok, text)))


def outcomes(env: Code, row: dict[str, Any], program: str) -> list[str]:
    return [o.detail for o in asyncio.run(env.run_tests(row, program)).outcomes]


def stray_processes() -> list[int]:
    return children.started_since_test_began()


# --- Bundled tasks ---------------------------------------------------------------------------------


def test_bundled_tasks_load_with_train_and_eval_disjoint(env: Code) -> None:
    train, eval_ = env.load_rows("train"), env.load_rows("eval")
    assert (len(train), len(eval_)) == (39, 12)
    ids = [row["task_id"] for row in train + eval_]
    assert len(set(ids)) == len(ids)
    assert all(len(row["tests"]) >= 3 for row in train + eval_)


def test_every_reference_solution_passes_all_its_tests_in_the_sandbox(tok: Any) -> None:
    env = make_env("code", tok)  # the default limits a run gets
    rows = env.load_rows("train") + env.load_rows("eval")

    async def score_all() -> list[float]:
        permits = asyncio.Semaphore(4)

        async def score(row: dict[str, Any]) -> float:
            async with permits:
                return (await env.run_tests(row, row["reference"])).score

        return await asyncio.gather(*map(score, rows))

    scores = asyncio.run(score_all())
    assert {row["task_id"]: s for row, s in zip(rows, scores, strict=True) if s != 1.0} == {}


def test_a_row_whose_tests_are_not_assert_equal_literal_is_named(tmp_path: Path, tok: Any) -> None:
    good = {"task_id": "a", "prompt": "def f():\n", "tests": ["assert f() == [1, (2, 'x')]"]}
    bad = {"task_id": "b", "prompt": "def f():\n", "tests": ["assert f() == 1", "assert f() == 2 ** 3"]}
    (tmp_path / "train.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: field 'tests': .*tests\[1\]: .*must be a Python literal"):
        make_env("code", tok, dataset=tmp_path).load_rows("train")
    with pytest.raises(ValueError, match="is not of the form"):
        split_test("assert f() != 1")
    assert split_test("assert sorted(f([3, 1])) == [1, 3]") == ("sorted(f([3, 1]))", [1, 3])


# --- The prompt and the program --------------------------------------------------------------------


def test_the_prompt_is_the_stub_in_the_chat_template(env: Code, tok: Any) -> None:
    text = tok.decode(env.render_prompt(FIB_ROW))
    assert text.startswith("<|im_start|>user\nComplete this Python function.")
    assert f"```python\n{FIB_ROW['prompt']}```<|im_end|>\n<|im_start|>assistant\n" in text


@pytest.mark.parametrize(
    ("text", "program"),
    [
        ("Here:\n```python\nx = 1\n```\nand a test:\n```python\nprint(x)\n```", "x = 1\n"),
        ("```\nbare = 1\n```", "bare = 1\n"),
        ("```text\nnot code\n```\n```py\ny = 2\n```", "y = 2\n"),
        ("def f():\n    return 1\n", "def f():\n    return 1\n"),
        ("```python\ndef cut_at_max_tokens():\n    return", "def cut_at_max_tokens():\n    return"),
    ],
)
def test_the_program_is_the_first_python_block_or_the_whole_text(text: str, program: str) -> None:
    assert extract_program(text) == program


# --- Rewards ---------------------------------------------------------------------------------------


def test_reference_scores_one_partial_credit_and_a_syntax_error_zero(env: Code, tok: Any) -> None:
    assert reward(env, tok, FIB_ROW, f"Sure.\n```python\n{FIB}```\nThis runs in O(n).") == 1.0
    off_by_one = FIB.replace("range(n)", "range(n - 1) if n > 1 else range(n)")
    assert reward(env, tok, FIB_ROW, f"```python\n{off_by_one}```") == 0.5
    assert outcomes(env, FIB_ROW, off_by_one) == ["passed", "passed", "returned 34, expected 55",
                                                  "returned 4181, expected 6765"]
    assert reward(env, tok, FIB_ROW, "```python\ndef fibonacci(n)\n    return n\n```") == 0.0
    assert outcomes(env, FIB_ROW, "def fibonacci(n)\n")[0].startswith("SyntaxError: ")
    assert reward(env, tok, FIB_ROW, "I do not know.") == 0.0


def test_only_a_value_of_the_exact_type_passes(env: Code) -> None:
    # Objects that claim equality, an int subclass, bools for ints, floats for ints: all wrong.
    cheats = {
        "class Yes:\n    def __eq__(self, other):\n        return True\ndef fibonacci(n):\n    return Yes()\n":
            "returned <Yes object>, expected 0",
        "class I(int):\n    def __eq__(self, other):\n        return True\ndef fibonacci(n):\n    return I(0)\n":
            "returned <I object>, expected 0",
        "def fibonacci(n):\n    return False\n": "returned False, expected 0",
        "def fibonacci(n):\n    return 0.0\n": "returned 0.0, expected 0",
    }
    for program, detail in cheats.items():
        assert outcomes(env, FIB_ROW, program)[0] == detail
    assert same([1.0, (2, "x")], [1.0 + 1e-12, (2, "x")]) and not same([1], [True]) and not same((1,), [1])


def test_a_program_cannot_forge_the_report(env: Code) -> None:
    # It finds the report's token and writes a report saying every call returned the right value,
    # through the harness's own stdout (via /proc) and its own, then exits early: only the harness's
    # report, written last, counts.
    forger = (
        "import json, os\n"
        "token = json.load(open('tests.json'))['token']\n"
        "fake = token + ' ' + json.dumps([{'value': ['int', v]} for v in (0, 1, 55, 6765)]) + '\\n'\n"
        "for path in ('/proc/1/fd/1', '/proc/%d/fd/1' % os.getppid(), '/dev/stdout'):\n"
        "    try:\n"
        "        open(path, 'w').write(fake)\n"
        "    except OSError:\n"
        "        pass\n"
        "os._exit(0)\n"
    )
    assert outcomes(env, FIB_ROW, forger) == ["the test's process ended without a result"] * 4


def test_a_looping_test_times_out_and_the_others_still_count(env: Code) -> None:
    loops_at_10 = FIB.replace("    a, b = 0, 1\n", "    while n == 10:\n        pass\n    a, b = 0, 1\n")
    started = time.monotonic()
    assert outcomes(env, FIB_ROW, loops_at_10) == ["passed", "passed", "timed out after 1.0 s", "passed"]
    assert time.monotonic() - started < 4
    assert asyncio.run(env.run_tests(FIB_ROW, loops_at_10)).score == 0.75


def test_a_program_that_loops_everywhere_scores_zero_within_the_wall_clock(env: Code, tok: Any) -> None:
    started = time.monotonic()
    assert reward(env, tok, FIB_ROW, "```python\nwhile True:\n    pass\n```") == 0.0
    # Four 1 s timeouts fit in the harness's budget (80% of wall_s = 5 s): one sandbox run, bounded.
    assert time.monotonic() - started < env.limits.wall_s + 2
    assert not stray_processes()


def test_a_fork_bomb_scores_zero_and_leaves_nothing_running(env: Code, tok: Any) -> None:
    bomb = "```python\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n```"
    assert reward(env, tok, FIB_ROW, bomb) == 0.0
    assert not stray_processes()


def test_a_memory_bomb_scores_zero(tok: Any) -> None:
    # A small address space keeps the bomb quick to go off on a busy machine.
    env = make_env("code", tok, memory_mb=128, wall_s=15, test_timeout_s=3.0)
    bomb = "blocks = []\nwhile True:\n    blocks.append(bytearray(10 << 20))\n"
    assert outcomes(env, FIB_ROW, bomb) == ["MemoryError: "] * 4


def test_writing_outside_its_directory_leaves_no_file(env: Code, tmp_path: Path) -> None:
    # The run directory stand-in (tmp_path), the host's temp dir, the root: none is there to write to
    # (the sandbox's own /tmp takes the write to /tmp); the solution is right, so it scores 1.
    name = f"escaped-{os.getpid()}-{time.time_ns()}"
    targets = [str(tmp_path / name), f"{tempfile.gettempdir()}/{name}", f"/{name}", f"../{name}"]
    program = (
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('out')\n"
        "    except OSError:\n"
        "        pass\n"
    ) + FIB
    assert asyncio.run(env.run_tests(FIB_ROW, program)).score == 1.0
    assert not any(Path(t).exists() for t in targets[:3]) and os.listdir(tmp_path) == []


def test_the_environments_secrets_are_invisible(env: Code, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"s3cret-{time.time_ns()}"
    monkeypatch.setenv("BEAM_RL_TEST_SECRET", secret)
    secret_file = tmp_path / "token"
    secret_file.write_text(secret)
    secret_file.chmod(0o600)
    program = (
        "import os\n"
        "def probe():\n"
        "    if 'BEAM_RL_TEST_SECRET' in os.environ:\n"
        "        return os.environ['BEAM_RL_TEST_SECRET']\n"
        f"    for path in [{str(secret_file)!r}, '/proc/{os.getpid()}/environ']:\n"
        "        try:\n"
        "            return open(path).read()\n"
        "        except OSError:\n"
        "            pass\n"
        "    return 'sealed'\n"
    )
    report = asyncio.run(env.run_tests(PROBE_ROW, program))
    assert report.score == 1.0, report.outcomes
    assert secret not in report.sandbox.stdout + report.sandbox.stderr


def test_a_network_connection_never_arrives(env: Code) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        program = (
            "import socket\n"
            "def probe():\n"
            "    try:\n"
            f"        socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=1).close()\n"
            "        return 'connected'\n"
            "    except OSError:\n"
            "        return 'sealed'\n"
        )
        assert asyncio.run(env.run_tests(PROBE_ROW, program)).score == 1.0
        with pytest.raises(TimeoutError):
            listener.accept()


def test_killing_the_orchestrator_or_its_parent_fails_only_the_program(env: Code, tok: Any) -> None:
    victim = subprocess.Popen(["sleep", "60"])
    try:
        program = (
            "import os, signal\n"
            "def probe():\n"
            f"    for pid in ({os.getpid()}, {victim.pid}):\n"
            "        try:\n"
            "            os.kill(pid, signal.SIGKILL)\n"
            "            return 'killed %d' % pid\n"
            "        except OSError:\n"
            "            pass\n"
            "    return 'sealed'\n"
        )
        assert asyncio.run(env.run_tests(PROBE_ROW, program)).score == 1.0
        # Its parent in the sandbox is the test harness: killing it forfeits the report, scored 0
        # (the program's failure), not a missing reward.
        patricide = "```python\nimport os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n```"
        assert reward(env, tok, PROBE_ROW, patricide) == 0.0
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_concurrent_rewards_each_score_their_own_program(env: Code, tok: Any) -> None:
    wrong, broken, zero = "def fibonacci(n):\n    return n\n", "def fibonacci(n)\n", "def fibonacci(n):\n    return 0\n"
    programs = [FIB, wrong, broken, FIB, zero]

    async def all_at_once() -> list[float]:
        return await asyncio.gather(*[env.reward(FIB_ROW, answer(tok, f"```python\n{p}```")) for p in programs])

    assert asyncio.run(all_at_once()) == [1.0, 0.5, 0.0, 1.0, 0.25]


# --- Infrastructure failures and configuration -----------------------------------------------------


def test_no_sandbox_makes_the_reward_unavailable_and_the_rollout_an_error(
    env: Code, tok: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(RewardUnavailable, match="bubblewrap"):
        reward(env, tok, FIB_ROW, FIB)
    trajectory = answer(tok, FIB)
    rollout = Rollout("g", "code", 0, 1, prompt_ids=[1], turns=trajectory.turns, row=FIB_ROW)
    assign_rewards([rollout], env)
    assert rollout.status is RolloutStatus.REWARD_ERROR and rollout.errors[0].startswith("RewardUnavailable: bubblewrap")


def test_sandbox_limits_come_from_the_constructor(tok: Any) -> None:
    env = make_env("code", tok, cpu_s=2, wall_s=20, memory_mb=256, processes=8, file_size_mb=4, test_timeout_s=3)
    assert env.limits == SandboxLimits(cpu_s=2, wall_s=20, memory_mb=256, processes=8, file_size_mb=4, network=False)
    assert env.test_timeout_s == 3
    with pytest.raises(ValueError, match=r"SandboxLimits\.processes must be a positive number, got 0"):
        make_env("code", tok, processes=0)
    with pytest.raises(ValueError, match="test_timeout_s must be > 0"):
        make_env("code", tok, test_timeout_s=0)
    with pytest.raises(TypeError, match="environment 'code': .*'network'"):
        make_env("code", tok, network=True)

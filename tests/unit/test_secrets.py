"""Secrets are never written and never handed on: a URL with credentials is refused when the config loads
(the config is written whole to the run directory and every tracker), wherever it holds one, without the
message printing it; and an env server beam-rl starts gets an agent's scrubbed environment plus only the
variables its config names."""

from __future__ import annotations

import asyncio
import io
import json
import os
import stat
import sys
from pathlib import Path

import pytest
from rich.console import Console

from beam_rl import cli
from beam_rl.config import ConfigError, load_config
from beam_rl.envs.env_servers import describe_env
from beam_rl.envs.verifiers_episodes import VerifiersEpisodes
from beam_rl.fleet.discovery import ServersFile

pytestmark = pytest.mark.timeout(60)

SECRET = "hunter2-s3cr3t"

BASE = """\
[run]
dir = "{run_dir}"
[inference]
{inference}
[[envs]]
name = "reverse_text"
{env}
"""

JUDGE = """\
[envs.reward.judge]
url = "{url}"
model = "grader"
prompt = "Grade: {{completion}}"
verdict = {{pattern = "([01])"}}
{extra}
"""

# kind: (the [inference] lines, the env entry's lines, the key named, what the message points to)
URLS_WITH_CREDENTIALS = {
    "inference url": (f'urls = ["http://vllm:{SECRET}@10.0.0.5:8000"]', "", "inference.urls[0]",
                      "name it in inference.api_key_env"),
    "dns discovery": (f'discovery = "dns"\ndns_name = "http://u:{SECRET}@vllm.ns.svc:8000"', "", "inference.dns_name",
                      "name it in inference.api_key_env"),
    "judge url": ("", JUDGE.format(url=f"https://grader:{SECRET}@judge.example", extra=""),
                  "envs[0].reward.judge.url", "name it in envs[0].reward.judge.api_key_env"),
    "an env's argument": ("", f'args = {{endpoint = "https://tok:{SECRET}@tools.example/v1"}}', "envs[0].args.endpoint",
                          "pass the key in an environment variable instead"),
    "judge url and api_key_env": ("", JUDGE.format(url=f"https://grader:{SECRET}@judge.example",
                                                   extra='api_key_env = "JUDGE_KEY"'),
                                  "envs[0].reward.judge.url",
                                  "credentials in the URL conflict with envs[0].reward.judge.api_key_env"),
}


@pytest.mark.parametrize("kind", list(URLS_WITH_CREDENTIALS))
def test_a_url_with_credentials_is_refused_at_load_without_printing_them(tmp_path, kind):
    inference, env, key, points_to = URLS_WITH_CREDENTIALS[kind]
    path = tmp_path / "run.toml"
    path.write_text(BASE.format(run_dir=tmp_path / "run", inference=inference, env=env))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert "\n" not in message and SECRET not in message
    assert message.startswith(f"invalid config {path}: {key}: ") and points_to in message


def run_cli(monkeypatch, *argv: str) -> tuple[int, str]:
    """`beam-rl ARGV` in this process: its exit status and what it printed (unwrapped)."""
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=10_000, color_system=None))
    return cli.main(list(argv)), out.getvalue().strip()


def test_beam_rl_run_refuses_it_before_anything_is_written(tmp_path, monkeypatch):
    path = tmp_path / "run.toml"
    path.write_text(BASE.format(run_dir=tmp_path / "run", inference=f'urls = ["https://me:{SECRET}@h:1"]', env=""))
    status, printed = run_cli(monkeypatch, "rollouts", "--config", str(path))
    assert status == 2
    assert "\n" not in printed and SECRET not in printed and "inference.urls[0]: a URL with credentials" in printed
    assert not (tmp_path / "run").exists()  # no config.json, no tracker: nothing holds it


def test_the_servers_file_refuses_one_too(tmp_path, monkeypatch):
    ServersFile.of_run(tmp_path).seed(["http://127.0.0.1:9"], embedded=False)
    status, printed = run_cli(monkeypatch, "servers", "add", str(tmp_path), f"http://u:{SECRET}@127.0.0.1:10")
    assert status == 2
    assert "a URL with credentials" in printed and SECRET not in printed and "\n" not in printed
    assert SECRET not in ServersFile.of_run(tmp_path).path.read_text()


# -- what an env server's process is given ------------------------------------------------------------------

# Credentials the worker holds, as a cluster's environment would.
WORKER_SECRETS = {"VLLM_API_KEY": SECRET, "OPENAI_API_KEY": SECRET, "AWS_SECRET_ACCESS_KEY": SECRET,
                  "JUDGE_KEY": SECRET}


@pytest.fixture
def fake_python(tmp_path: Path) -> tuple[Path, Path]:
    """An "interpreter" that writes the environment it was given to a file and, asked to describe an
    environment or to set up its harnesses, answers both at once (the resolved config, no harness to set up):
    what a real env server's Python would see."""
    seen = tmp_path / "environ.json"
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\nimport json, os\n"
                      f"open({str(seen)!r}, 'w').write(json.dumps(dict(os.environ)))\n"
                      "print(json.dumps({'config': {'taskset': {'id': 'toy'}}, 'rows': [{'q': 1}], 'harnesses': {}}))\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, seen


def test_an_env_server_gets_no_credential_of_the_worker_only_what_pass_env_names(tok, fake_python, monkeypatch):
    python, seen = fake_python
    for name, value in WORKER_SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TOOL_TOKEN", "for-the-tool")

    # Loading the environment (its rows) runs its code under that python.
    describe_env({"taskset": {"id": "toy"}}, str(python), ("TOOL_TOKEN",))
    described = json.loads(seen.read_text())

    # The server the env entry starts, as its config builds it. (Its protocol's client needs verifiers, whose
    # import takes tens of seconds here; what is tested is the process it spawns.)
    env = VerifiersEpisodes(tok, env="toy", server="process", python=str(python), pass_env=["TOOL_TOKEN"])
    server = env._server()

    async def spawn() -> None:
        await server._spawn()
        await server.process.wait()

    try:
        asyncio.run(spawn())
    finally:
        asyncio.run(server.close())
    spawned = json.loads(seen.read_text())

    for environ in (described, spawned):
        assert not set(WORKER_SECRETS) & set(environ), sorted(environ)
        assert SECRET not in json.dumps(environ)
        assert environ["TOOL_TOKEN"] == "for-the-tool" and environ["PATH"] == os.environ["PATH"]
        assert "PYTHONPATH" not in environ  # another interpreter: the worker's packages do not shadow its own


def test_pass_env_is_for_a_server_beam_rl_starts(tok):
    with pytest.raises(ValueError, match=r"pass_env names variables for an env server beam-rl starts \(server = "
                                         r"\"process\"\)"):
        VerifiersEpisodes(tok, env="toy", server="inline", pass_env=["TOOL_TOKEN"])

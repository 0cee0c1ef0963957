"""TRL as a peer (bench/peers/trl_peer.py, trl_loop.py): the command the harness launches agrees with the loop
script's own arguments, the loop posts the prompts file's exact token ids, and TRL's samples become the
contract's lines. The run against real servers is the harness's (`python -m bench.peers.compare --peers trl`):
it needs TRL's venv, built from PyPI."""

from __future__ import annotations

from pathlib import Path

import pytest

from beam_rl.cache import cache_root
from beam_rl.model.tiny import tiny_model_dir
from bench.peers import trl_loop
from bench.peers.job import SLOTS_PER_SERVER, PeerJob, load_job
from bench.peers import trl_peer
from bench.peers.shims.venvs import peer_dir, venv_python
from bench.peers.trl_peer import LOOP, Trl

URLS = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache of this test's own, sharing the machine's tiny model (built once, offline)."""
    (tmp_path / "models").symlink_to(tiny_model_dir().parent)
    monkeypatch.setenv("BEAM_RL_CACHE", str(tmp_path))
    return tmp_path


def job(tmp_path: Path) -> PeerJob:
    return PeerJob(
        name="short",
        urls=URLS,
        model="tiny",
        prompts_path=tmp_path / "prompts.jsonl",
        group_size=4,
        max_tokens=64,
        groups=8,
        out_path=tmp_path / "rollouts.jsonl",
        work_dir=tmp_path / "peer",
        seed=0,
    )


def test_the_command_runs_trls_loop_from_its_own_venv_on_the_first_server_with_the_fleets_slots(
    own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert peer_dir("trl") == cache_root() / "peers" / "trl"
    assert Trl().unavailable() is not None  # nothing built in this cache
    monkeypatch.setattr(trl_peer, "is_built", lambda name, pins, exclude_newer: name == "trl")
    assert Trl().unavailable() is None
    given = job(own_cache)
    argv = Trl().command(given)
    loop_at = argv.index(str(LOOP))
    assert argv[0] == "env" and argv[loop_at - 1] == str(venv_python("trl"))
    assert "HF_HUB_OFFLINE=1" in argv[:loop_at]  # the loop never reaches for the hub
    args = trl_loop.parse_args(argv[loop_at + 1 :])  # what the loop itself reads from the argv
    assert load_job(args.job) == given and args.tokenizer == str(tiny_model_dir())
    settings = trl_loop.worker_settings(given)
    assert (settings["vllm_server_url"], settings["max_inflight_tasks"]) == (URLS[0], len(URLS) * SLOTS_PER_SERVER)
    assert (settings["model_name"], settings["num_generations"], settings["max_tokens"]) == ("tiny", 4, 64)


def test_until_its_venv_is_built_it_is_unavailable_in_one_line_naming_the_venv(own_cache: Path) -> None:
    why = Trl().unavailable()
    assert why is not None and "not built" in why and str(venv_python("trl").parent.parent) in why and "\n" not in why
    with pytest.raises(RuntimeError, match="not built"):
        Trl().command(job(own_cache))


def test_the_worker_posts_the_prompts_own_token_ids_and_renders_any_other_conversation_with_the_template() -> None:
    tokenizer = trl_loop.PromptIdsTokenizer.from_pretrained(tiny_model_dir())
    ids = [327, 263, 140, 159, 23, 41, 11, 92, 416, 333]  # random tokens, as the harness's workloads draw them
    prompt = tokenizer.decode(ids)
    assert tokenizer.encode(prompt) != ids  # so rendering the text would post another prompt
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt, "prompt_ids": ids}], return_dict=False, add_generation_prompt=True
    )
    assert rendered == ids
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False).startswith("<|im_start|>user\nhi<|im_end|>")


def test_trls_samples_become_contract_lines_with_its_groups_cycling_through_the_prompts() -> None:
    group_ids = ["short/0", "short/1", "short/2"]
    stop = {2, 0}  # the tiny tokenizer's EOS and pad
    prompt, answer = [5, 6, 7], [9, 10, 2]
    line = trl_loop.rollout_line(4, [0, 0, 0, 1, 1, 1], prompt + answer, stop, group_ids)
    assert line == {"group_id": "short/1", "completion_tokens": 3, "finish_reason": "stop"}
    clipped = trl_loop.rollout_line(2, [0, 0, 0, 1, 1], prompt + [9, 10], stop, group_ids)
    assert clipped == {"group_id": "short/2", "completion_tokens": 2, "finish_reason": "length"}

"""beam-rl's adapter in the side-by-side harness (bench/peers/beam_rl_peer.py): its follower turns committed
rollouts into the contract's lines, and a follower that fails makes the job fail instead of delivering less."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.peers import beam_rl_peer
from bench.peers.beam_rl_peer import Follower
from bench.peers.job import read_rollouts


def test_each_rollout_is_named_by_the_prompts_files_line_and_one_past_it_by_beam_rls_own_id(tmp_path: Path) -> None:
    """Multi-turn rows come epoch after epoch (two rows an epoch here); a run may finish a row past the file's."""
    out_path = tmp_path / "rollouts.jsonl"
    follower = Follower(tmp_path / "run", out_path, ["first", "second", "third"], per_epoch=2)
    with open(out_path, "a") as out:
        follower._deliver(out, [
            {"group_id": "guess/e0-i1", "truncated": False, "status": "ok", "completion_tokens": 3},
            {"group_id": "guess/e1-i0", "truncated": True, "status": "ok", "completion_tokens": 4},
            {"group_id": "guess/e1-i1", "truncated": False, "status": "error", "completion_tokens": 0},
        ])
    rows = read_rollouts(out_path)
    assert [(r["group_id"], r["finish_reason"]) for r in rows] == [
        ("second", "stop"), ("third", "length"), ("beam-rl:guess/e1-i1", "error")]


def test_a_follower_that_fails_fails_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Follower) -> None:
        raise IndexError("no such line")

    monkeypatch.setattr(Follower, "_follow", broken)
    monkeypatch.setattr(beam_rl_peer, "job_config", lambda job, runner, mode: None)
    monkeypatch.setattr(beam_rl_peer, "read_prompts", lambda path: [])

    class _Job:
        work_dir, out_path, prompts_path, name, urls = tmp_path, tmp_path / "out.jsonl", tmp_path, "short", []

    monkeypatch.setattr(beam_rl_peer, "load_job", lambda path: _Job())
    monkeypatch.setattr("beam_rl.job.rollouts.run_rollouts", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="following the run directory failed: IndexError"):
        beam_rl_peer.main(["--job", str(tmp_path / "job.json")])


@pytest.mark.parametrize("groups", [32, 160, 320, 440])
def test_the_multi_turn_run_offers_exactly_the_jobs_groups_and_each_lands_on_its_prompts_line(
        tmp_path: Path, groups: int) -> None:
    """A run offered more conversations than it asks for keeps the surplus in flight at its end, which the harness
    would count as thrown away; each game row beam-rl draws is the prompts file's line the follower names."""
    from bench.peers.job import PeerJob
    from bench.peers.workloads import GROUP_SIZE, multi_turn_epochs, multi_turn_rows, prompts

    job = PeerJob(name="multi_turn", urls=["http://127.0.0.1:1"], model="tiny", prompts_path=tmp_path / "p.jsonl",
                  group_size=GROUP_SIZE, max_tokens=32, groups=groups, out_path=tmp_path / "out.jsonl",
                  work_dir=tmp_path, seed=0)
    env = beam_rl_peer.job_config(job, "direct").envs[0]
    assert env.epochs * env.limit == groups
    lines, rows, per_epoch = prompts("multi_turn", groups, seed=0), multi_turn_rows(), multi_turn_epochs(groups)[1]
    for epoch in range(env.epochs):
        for row in range(env.limit):
            line = beam_rl_peer._prompt_line(f"guess_number/e{epoch}-i{row}", per_epoch)
            assert lines[line]["prompt_ids"] == rows[row]["prompt_ids"]

"""WeightSync: published weights reach the inference servers, the policy version advances, and
in-flight rollouts the new policy made too stale are generated again under it, and counted."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest
import torch

from beam_rl import wiring
from beam_rl.config import config_from_dict
from beam_rl.dispatch.weight_sync import WeightSync
from beam_rl.rundir import RunDir
from beam_rl.source import DispatchRange, RolloutSource, Shard, SourceSpec
from beam_rl.standin.server import EmbeddedServer, FaultConfig
from beam_rl.model.tiny import load_tiny_model, tiny_model_dir
from beam_rl.trainer.checkpoint import publish_weights
from tests.support.server_helpers import metrics
from tests.support.paths import REPO


def _perturbed_model(seed: int):
    model = load_tiny_model(tiny_model_dir())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.5)
    return model


def _source(tmp_path, url, **off_policy) -> RolloutSource:
    config = config_from_dict({
        "run": {"dir": str(tmp_path), "max_steps": 100},
        "envs": [{"name": "reverse_text", "group_size": 4, "limit": 8}],
        "batch": {"rollouts_per_step": 8},
        "inference": {"max_tokens": 8, "max_inflight": 8},
        "off_policy": off_policy or {"max_async_level": 1, "max_off_policy_steps": 1},
    })
    spec = SourceSpec(config=config, server_urls=(url,), run_dir=str(tmp_path), run_id=uuid.uuid4().hex)
    return wiring.dispatch_parts(spec).source(Shard(), DispatchRange(0, 9))


def _drain(source: RolloutSource, expected: int, timeout_s: float = 60.0):
    rollouts, deadline = [], time.monotonic() + timeout_s
    while len(rollouts) < expected and time.monotonic() < deadline:
        rollouts += source.poll(0.05)
    assert len(rollouts) == expected, f"got {len(rollouts)} of {expected} rollouts"
    return rollouts


def test_sync_is_rate_limited_validates_first_and_only_moves_forward(tmp_path):
    run_dir, calls = RunDir(tmp_path), []
    now = [0.0]
    sync = WeightSync(run_dir, update=lambda p, v: calls.append(("reload", p.name, v)),
                      validate=lambda p: calls.append(("validate", p.name)), poll_s=1.0, clock=lambda: now[0])
    assert sync.poll() is None and sync.version == 0
    for step in (1, 2):
        with run_dir.publish_weights_dir(step) as d:
            (d / "model.safetensors").write_bytes(b"x")
    assert sync.poll() is None  # within poll_s of the last look
    now[0] = 1.5
    update = sync.poll()
    assert update.version == 2 and sync.version == 2 and sync.updates == [update]
    assert calls == [("validate", "step_2"), ("reload", "step_2", 2)]  # newest only, validated before loading
    now[0] = 3.0
    assert sync.poll() is None


def test_a_bad_checkpoint_is_refused_before_any_server_loads_it(tmp_path):
    run_dir, reloads = RunDir(tmp_path), []

    def validate(path):
        raise ValueError(f"{path}: tensor shapes differ")

    with run_dir.publish_weights_dir(1) as d:
        (d / "model.safetensors").write_bytes(b"x")
    sync = WeightSync(run_dir, update=lambda p, v: reloads.append(p), validate=validate, poll_s=0.0)
    with pytest.raises(ValueError, match="tensor shapes differ"):
        sync.poll()
    assert reloads == [] and sync.version == 0


def test_published_weights_change_generations_and_advance_the_version(tmp_path):
    with EmbeddedServer(model_dir=tiny_model_dir(), served_model_name="tiny") as server:
        first = _source(tmp_path, server.url)
        try:
            first.admit(0)
            before = {r.rollout_id: r.turns[0].completion_ids for r in _drain(first, 4)}
        finally:
            first.close()
        publish_weights(RunDir(tmp_path), 1, _perturbed_model(seed=1), source_dir=tiny_model_dir())
        # Same run seed, so group 0 gets the same sampling seeds; only the weights differ.
        # (A resumed run's source must not generate with the initial weights either.)
        second = _source(tmp_path, server.url)
        try:
            assert second.policy_version() == 1  # a source syncs the servers when it starts
            second.admit(0)
            rollouts = _drain(second, 4)
        finally:
            second.close()
    after = {r.rollout_id: r.turns[0].completion_ids for r in rollouts}
    assert {r.policy_version_start for r in rollouts} == {1}
    assert before.keys() == after.keys()
    assert before != after  # the server generates with the published weights


def test_a_rollout_made_too_stale_while_it_generates_is_generated_again_under_the_new_policy(tmp_path):
    # Slow decode steps: the update lands while the group's rollouts are streaming their tokens.
    with EmbeddedServer(model_dir=tiny_model_dir(), served_model_name="tiny",
                        faults=FaultConfig(step_delay_s=0.25)) as server:
        source = _source(tmp_path, server.url, max_async_level=1, max_off_policy_steps=1)
        try:
            source.admit(0)
            deadline = time.monotonic() + 20
            while metrics(server.url)["vllm:generation_tokens_total"] < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert source.poll(0) == []  # none finished: every rollout holds version 0 tokens
            for step in (1, 2):  # version 2 - max_off_policy_steps 1 > version 0 of their first tokens
                publish_weights(RunDir(tmp_path), step, load_tiny_model(tiny_model_dir()),
                                source_dir=tiny_model_dir())
            time.sleep(0.3)
            source.wants_more()  # the source follows the run: new weights, then stale rollouts regenerated
            rollouts = _drain(source, 4, timeout_s=60)
            assert source.policy_version() == 2
            assert all(r.ok and r.policy_version_start == 2 for r in rollouts), [r.errors for r in rollouts]
            assert {v for r in rollouts for t in r.turns for v in t.policy_versions} == {2}
            assert all(r.discarded_tokens["stale"] > 0 for r in rollouts)  # what each had generated before
            counters = source.counters()
            assert counters["regenerated"] == 4 and counters["cancelled"] == 0 and counters["cancelled_stale"] == 0
        finally:
            source.close()
    (update,) = [m["weight_update"] for m in RunDir(tmp_path).read_metrics() if "weight_update" in m]
    assert update["version"] == 2 and update["regenerated_rollouts"] == 4
    (server_update,) = update["servers"]
    assert server_update["mode"] == "keep" and server_update["paused_s"] >= server_update["reload_s"] > 0


def test_the_dispatch_worker_checks_a_checkpoint_without_importing_torch(tmp_path):
    """The check runs in the worker that dispatches: importing torch there held its GIL ~2 s at the
    first update, while the dispatcher's event loop waited."""
    code = (
        "import sys\n"
        "import transforms.dispatch, transforms.score, transforms.pack\n"
        "from beam_rl import wiring\n"
        "from beam_rl.rundir.checkpoint_shapes import CheckpointError\n"
        "from beam_rl.config import config_from_dict\n"
        "from beam_rl.model.tiny import tiny_model_dir\n"
        "check = wiring.checkpoint_validator(config_from_dict({'envs': [{'name': 'reverse_text'}]}))\n"
        "check(tiny_model_dir())\n"
        f"try:\n    check({str(tmp_path)!r})\nexcept CheckpointError:\n    pass\nelse:\n    raise SystemExit('no error')\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"

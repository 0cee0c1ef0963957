"""The reference trainer on a synthetic run dir: publishing, checkpoint validation, gradient sign, resume, stop."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from beam_rl.config import TrainerSection
from beam_rl.rundir import CommitRecordError, RunDir, StepAlreadyCommittedError, StepCorruptError
from beam_rl.rundir.checkpoint_shapes import CheckpointError, validate_checkpoint
from beam_rl.model.tiny import load_tiny_model, tiny_model_dir
from beam_rl.trainer.checkpoint import optimizer_state_path, publish_weights
from beam_rl.trainer.reference import ReferenceTrainer, run_trainer
from tests.support.step_damage import FILE_DAMAGE, RECORD_DAMAGE
from tests.support.train_steps import completion_logprob_sum, make_samples, weights_of, write_step


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(0, cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def base_model(model_dir):
    return load_tiny_model(model_dir)


# -- publishing and validating checkpoints ------------------------------------------------------------


def test_publish_weights_writes_a_loadable_vllm_style_directory_with_stable_last(tmp_path, model_dir, base_model):
    run = RunDir(tmp_path / "run")
    path = publish_weights(run, 1, base_model)
    assert path == run.weights_path(1) and run.is_stable(1) and run.latest_stable_weights() == (1, path)
    # Config, tokenizer and chat template come from the source directory verbatim (vLLM-readable spellings).
    copied = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    for name in copied:
        assert (path / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert json.loads((path / "config.json").read_text())["rope_theta"] == 10000.0
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["model.safetensors"]
    reloaded = load_tiny_model(path)
    for name, tensor in base_model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, rtol=0, atol=0)
    with pytest.raises(StepAlreadyCommittedError):
        publish_weights(run, 1, base_model)


def test_validate_checkpoint_accepts_the_published_weights(tmp_path, model_dir, base_model):
    path = publish_weights(RunDir(tmp_path), 1, base_model)
    shapes = validate_checkpoint(path, model_dir)
    assert shapes["model.embed_tokens.weight"] == (512, 128)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (64, 128)


def test_validate_checkpoint_names_every_shape_mismatch(tmp_path, model_dir, base_model):
    config = Qwen2Config.from_pretrained(model_dir)
    config.intermediate_size = 64
    Qwen2ForCausalLM(config).save_pretrained(str(tmp_path / "other"))
    with pytest.raises(CheckpointError) as info:
        validate_checkpoint(tmp_path / "other", model_dir)
    message = str(info.value)
    assert f"checkpoint {tmp_path / 'other'} does not match reference model {model_dir}" in message
    assert "model.layers.0.mlp.gate_proj.weight: shape (64, 128) != reference (128, 128)" in message
    assert message.count("!= reference") == 6 and "more" not in message  # gate/up/down of both layers


def test_validate_checkpoint_reports_missing_and_unexpected_tensors(tmp_path, model_dir, base_model):
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors.pop("model.norm.weight")
    tensors["model.extra.weight"] = torch.zeros(2, 2)
    (tmp_path / "ckpt").mkdir()
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    expected = r"missing tensor model.norm.weight \(128,\); unexpected tensor model.extra.weight \(2, 2\)"
    with pytest.raises(CheckpointError, match=expected):
        validate_checkpoint(tmp_path / "ckpt", model_dir)


def test_validate_checkpoint_rejects_a_directory_without_weights_or_with_a_corrupt_file(tmp_path, model_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        validate_checkpoint(tmp_path / "empty", model_dir)
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes()[:100])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        validate_checkpoint(tmp_path / "torn", model_dir)


def test_validate_checkpoint_accepts_a_tied_lm_head_stored_explicitly(tmp_path, model_dir):
    tensors = load_file(str(model_dir / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # tied: save_pretrained stores the embedding only
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    (tmp_path / "ckpt").mkdir()
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    assert "lm_head.weight" not in validate_checkpoint(tmp_path / "ckpt", model_dir)


# -- the training loop ---------------------------------------------------------------------------------


def test_trainer_consumes_steps_and_publishes_changed_weights_with_metrics(tmp_path, model_dir, base_model):
    run = RunDir(tmp_path)
    for step in (1, 2):
        write_step(run, step, make_samples(base_model, step, [1.0, -1.0, 0.5, -0.5]))
    seen = []
    metrics = run_trainer(run, model_dir, TrainerSection(), max_steps=2, seed=0, timeout_s=10, progress=seen.append)
    assert [m["step"] for m in metrics] == [1, 2] and seen == metrics
    assert run.stable_weight_steps() == [1, 2]
    assert [line["trainer"] for line in run.read_metrics()] == json.loads(json.dumps(metrics))
    first = metrics[0]
    assert first["policy_version"] == 1 and first["samples"] == 4 and first["ranks"] == 1
    assert first["grad_norm"] > 0 and first["staleness_max"] == 0 and first["reward_mean"] == 0.5
    for key in ("wait_s", "read_s", "compute_s", "publish_s"):
        assert first[key] >= 0
    initial = weights_of(base_model)
    for step in (1, 2):
        published = load_tiny_model(run.weights_path(step)).state_dict()
        assert set(published) == set(initial)
        assert any(not torch.equal(published[k], initial[k]) for k in initial)
        validate_checkpoint(run.weights_path(step), model_dir)
    assert not torch.equal(load_file(str(run.weights_path(1) / "model.safetensors"))["model.norm.weight"],
                           load_file(str(run.weights_path(2) / "model.safetensors"))["model.norm.weight"])


def test_ratio_is_one_on_the_first_step_when_inference_logprobs_are_the_models_own(tmp_path, model_dir, base_model):
    run = RunDir(tmp_path)
    samples = make_samples(base_model, 7, [1.0, -1.0, 2.0, 0.5, -0.5, 1.0])
    write_step(run, 1, samples, ranks=2)  # two ranks: one process trains on both files
    (m,) = ReferenceTrainer(run, model_dir, TrainerSection()).train(max_steps=1, timeout_s=10)
    assert m["ranks"] == 2 and m["micro_batches"] >= 2
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert (m["ratio_min"], m["ratio_max"]) == (pytest.approx(1.0, abs=1e-5), pytest.approx(1.0, abs=1e-5))
    assert m["clip_fraction"] == 0.0 and m["mismatch_kl"] == pytest.approx(0.0, abs=1e-6)
    # With ratio 1 the loss is minus the token-mean advantage over every trainable token of the step.
    trained = [(float(s.advantages[s.loss_mask][0]), int(s.loss_mask.sum())) for s in samples]
    tokens = sum(n for _, n in trained)
    assert m["trainable_tokens"] == tokens and m["tokens"] == sum(len(s) for s in samples)
    assert m["loss"] == pytest.approx(-sum(a * n for a, n in trained) / tokens, abs=1e-5)


@pytest.mark.parametrize("advantage, direction", [(1.0, +1), (-1.0, -1)])
def test_one_step_moves_the_logprob_of_its_samples_in_the_direction_of_the_advantage(
    tmp_path, model_dir, base_model, advantage, direction
):
    run = RunDir(tmp_path)
    samples = make_samples(base_model, 3, [advantage] * 4)
    write_step(run, 1, samples)
    trainer = ReferenceTrainer(run, model_dir, TrainerSection(lr=1e-3))
    before = completion_logprob_sum(trainer.model, samples)
    trainer.train(max_steps=1, timeout_s=10)
    after = completion_logprob_sum(trainer.model, samples)
    assert direction * (after - before) > 0.05, (before, after)
    # The published weights are the trained policy.
    assert completion_logprob_sum(load_tiny_model(run.weights_path(1)), samples) == pytest.approx(after, abs=1e-4)


def test_a_step_without_trainable_tokens_publishes_unchanged_weights(tmp_path, model_dir, base_model):
    run = RunDir(tmp_path)
    samples = make_samples(base_model, 4, [1.0, -1.0])
    for s in samples:
        s.loss_mask[:] = False
    write_step(run, 1, samples)
    (m,) = run_trainer(run, model_dir, TrainerSection(), max_steps=1, timeout_s=10)
    assert (m["trainable_tokens"], m["loss"], m["grad_norm"], m["clip_fraction"]) == (0, 0.0, 0.0, 0.0)
    published = load_tiny_model(run.weights_path(1)).state_dict()
    assert all(torch.equal(published[k], v) for k, v in base_model.state_dict().items())


def test_resume_continues_after_the_latest_stable_weights_like_an_uninterrupted_run(tmp_path, model_dir, base_model):
    steps = {step: make_samples(base_model, 10 + step, [1.0, -1.0, 0.5, -0.5]) for step in (1, 2, 3)}
    straight, resumed = RunDir(tmp_path / "straight"), RunDir(tmp_path / "resumed")
    for run in (straight, resumed):
        for step, samples in steps.items():
            write_step(run, step, samples)
    run_trainer(straight, model_dir, TrainerSection(), max_steps=3, timeout_s=10)
    assert [m["step"] for m in run_trainer(resumed, model_dir, TrainerSection(), max_steps=2, timeout_s=10)] == [1, 2]

    trainer = ReferenceTrainer(resumed, model_dir, TrainerSection())
    assert trainer.start_step == 3 and trainer.resumed_optimizer
    step2 = load_file(str(resumed.weights_path(2) / "model.safetensors"))
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in step2.items())
    assert [m["step"] for m in trainer.train(max_steps=3, timeout_s=10)] == [3]
    # Same weights as never stopping: the AdamW moments were restored with the policy.
    a = load_file(str(straight.weights_path(3) / "model.safetensors"))
    b = load_file(str(resumed.weights_path(3) / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Only the latest optimizer state is kept.
    assert not optimizer_state_path(resumed, 2).exists() and optimizer_state_path(resumed, 3).exists()
    assert run_trainer(resumed, model_dir, TrainerSection(), max_steps=3, timeout_s=10) == []  # nothing left


def test_resume_refuses_stable_weights_of_another_model(tmp_path, model_dir):
    run = RunDir(tmp_path)
    config = Qwen2Config.from_pretrained(model_dir)
    config.num_hidden_layers, config.layer_types = 1, config.layer_types[:1]
    with run.publish_weights_dir(1) as directory:
        Qwen2ForCausalLM(config).save_pretrained(str(directory))
    # Layer 1's 12 tensors are missing: the first 6 are named, the rest counted.
    with pytest.raises(CheckpointError, match=r"missing tensor model.layers.1.input_layernorm.weight .*; and 6 more$"):
        ReferenceTrainer(run, model_dir, TrainerSection())


def test_waiting_for_a_step_times_out_naming_it(tmp_path, model_dir):
    trainer = ReferenceTrainer(tmp_path, model_dir, TrainerSection())
    with pytest.raises(TimeoutError, match="step 1 not committed within 0.05 s"):
        trainer.train(max_steps=1, timeout_s=0.05)
    assert RunDir(tmp_path).stable_weight_steps() == []


def test_stop_event_ends_a_trainer_waiting_for_data(tmp_path, model_dir):
    stop = threading.Event()
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(run_trainer(tmp_path, model_dir, TrainerSection(), max_steps=5, stop_event=stop))
    )
    thread.start()
    stop.set()
    thread.join(timeout=30)
    assert not thread.is_alive() and result == [[]]


# -- damaged steps: the trainer's reads are verified against the commit record ------------------------------


@pytest.mark.parametrize("damage", sorted(FILE_DAMAGE))
def test_a_damaged_rank_file_stops_the_trainer_before_any_update_naming_it(tmp_path, model_dir, base_model, damage):
    run = RunDir(tmp_path)
    write_step(run, 1, make_samples(base_model, 1, [1.0, -1.0, 0.5, -0.5]), ranks=2)
    damage_file, says = FILE_DAMAGE[damage]
    path = run.rank_path(1, 1)
    damage_file(path)
    trainer = ReferenceTrainer(run, model_dir, TrainerSection())
    before = weights_of(trainer.model)
    with pytest.raises(StepCorruptError, match=rf"^{re.escape(str(path))}: step 1 is corrupt: {says}$"):
        trainer.train(max_steps=1, timeout_s=10)
    # Nothing trained, published or recorded: the step can be repaired and trained again.
    assert trainer.step == 1 and run.stable_weight_steps() == [] and run.read_metrics() == []
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())


@pytest.mark.parametrize("damage", sorted(RECORD_DAMAGE))
def test_a_damaged_commit_record_stops_the_trainer_naming_it(tmp_path, model_dir, base_model, damage):
    run = RunDir(tmp_path)
    write_step(run, 1, make_samples(base_model, 1, [1.0, -1.0]))
    damage_record, says = RECORD_DAMAGE[damage]
    damage_record(run.commit_path(1))
    with pytest.raises(CommitRecordError, match=rf"^{re.escape(str(run.commit_path(1)))}: {says}"):
        run_trainer(run, model_dir, TrainerSection(), max_steps=1, timeout_s=10)
    assert run.stable_weight_steps() == []


def test_a_stray_file_in_a_step_does_not_change_what_the_trainer_trains(tmp_path, model_dir, base_model):
    samples = make_samples(base_model, 5, [1.0, -1.0, 0.5, -0.5])
    clean, with_stray = RunDir(tmp_path / "clean"), RunDir(tmp_path / "stray")
    for run in (clean, with_stray):
        write_step(run, 1, samples)
    other = RunDir(tmp_path / "other")
    write_step(other, 1, make_samples(base_model, 6, [2.0, -2.0, 2.0, -2.0]))
    (with_stray.step_dir(1) / "rank_1.arrow").write_bytes(other.rank_path(1, 0).read_bytes())  # not in the record
    for run in (clean, with_stray):
        run_trainer(run, model_dir, TrainerSection(), max_steps=1, timeout_s=10)
    a = load_file(str(clean.weights_path(1) / "model.safetensors"))
    b = load_file(str(with_stray.weights_path(1) / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["trainer"]["ranks"] for m in with_stray.read_metrics()] == [1]

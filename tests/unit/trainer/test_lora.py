"""The trainer with trainer.lora: a peft adapter trains over the frozen model, each step publishes the adapter
alone (validated against the model from its safetensors headers), and a resume continues from it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from beam_rl.config import LoraSection, TrainerSection
from beam_rl.rundir import RunDir
from beam_rl.rundir.checkpoint_shapes import CheckpointError, is_adapter, validate_checkpoint
from beam_rl.model.tiny import load_tiny_model
from beam_rl.trainer.reference import ReferenceTrainer, run_trainer, with_lora
from tests.support.train_steps import completion_logprob_sum, make_samples, weights_of, write_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LORA = LoraSection(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def base_model(model_dir):
    return load_tiny_model(model_dir)


def test_a_lora_step_trains_the_adapter_alone_and_publishes_it_in_peft_layout(tmp_path, model_dir, base_model):
    run = RunDir(tmp_path)
    samples = make_samples(base_model, 3, [1.0] * 4)
    write_step(run, 1, samples)
    trainer = ReferenceTrainer(run, model_dir, TrainerSection(lr=1e-2, lora=LORA))
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable} == {"q_proj", "v_proj"}
    before = completion_logprob_sum(trainer.model, samples)
    assert before == pytest.approx(completion_logprob_sum(base_model, samples), abs=1e-5)  # B = 0: the base model
    (metrics,) = trainer.train(max_steps=1, timeout_s=10)
    assert metrics["grad_norm"] > 0
    after = completion_logprob_sum(trainer.model, samples)
    assert after - before > 0.05, (before, after)  # the positive advantage raised its tokens' logprobs

    published = run.weights_path(1)
    assert is_adapter(published) and not (published / "model.safetensors").exists()
    config = json.loads((published / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    shapes = validate_checkpoint(published, model_dir, lora=True)
    assert len(shapes) == 2 * 2 * 2  # A and B of q_proj and v_proj in each of the tiny model's 2 layers
    # The base stays frozen: the adapter over the untouched model is the trained policy.
    assert all(torch.equal(v, base_model.state_dict()[k]) for k, v in weights_of(load_tiny_model(model_dir)).items())
    reloaded = with_lora(load_tiny_model(model_dir), LORA, seed=0, adapter_dir=published)
    assert completion_logprob_sum(reloaded, samples) == pytest.approx(after, abs=1e-4)


def test_a_resumed_lora_run_continues_from_the_published_adapter_like_an_uninterrupted_one(
        tmp_path, model_dir, base_model):
    steps = {step: make_samples(base_model, 20 + step, [1.0, -1.0, 0.5, -0.5]) for step in (1, 2, 3)}
    straight, resumed = RunDir(tmp_path / "straight"), RunDir(tmp_path / "resumed")
    for run in (straight, resumed):
        for step, samples in steps.items():
            write_step(run, step, samples)
    cfg = TrainerSection(lora=LORA)
    run_trainer(straight, model_dir, cfg, max_steps=3, timeout_s=10)
    run_trainer(resumed, model_dir, cfg, max_steps=2, timeout_s=10)
    trainer = ReferenceTrainer(resumed, model_dir, cfg)
    assert trainer.start_step == 3 and trainer.resumed_optimizer
    trainer.train(max_steps=3, timeout_s=10)
    a = load_file(str(straight.weights_path(3) / "adapter_model.safetensors"))
    b = load_file(str(resumed.weights_path(3) / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_whole_weights_and_adapters_are_not_taken_for_each_other(tmp_path, model_dir, base_model):
    run = RunDir(tmp_path)
    write_step(run, 1, make_samples(base_model, 5, [1.0, -1.0]))
    run_trainer(run, model_dir, TrainerSection(lora=LORA), max_steps=1, timeout_s=10)
    with pytest.raises(CheckpointError, match="a LoRA adapter, but the run trains whole weights"):
        validate_checkpoint(run.weights_path(1), model_dir)
    with pytest.raises(CheckpointError, match="a LoRA adapter, but the run trains whole weights"):
        ReferenceTrainer(run, model_dir, TrainerSection())  # a LoRA run resumed without trainer.lora


def test_an_adapter_that_does_not_fit_the_model_is_named_tensor_by_tensor(tmp_path, model_dir, base_model):
    run = RunDir(tmp_path)
    write_step(run, 1, make_samples(base_model, 6, [1.0, -1.0]))
    run_trainer(run, model_dir, TrainerSection(lora=LORA), max_steps=1, timeout_s=10)
    path = run.weights_path(1) / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.lora_B.weight"))
    tensors[name] = torch.zeros(7, 4)  # q_proj's output is 128 wide
    tensors["base_model.model.model.layers.0.mlp.nope.lora_A.weight"] = torch.zeros(4, 128)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError) as err:
        validate_checkpoint(run.weights_path(1), model_dir, lora=True)
    assert "q_proj: lora_A (4, 128) and lora_B (7, 4) do not fit its weight (128, 128)" in str(err.value)
    assert "model.layers.0.mlp.nope: no Linear of that name in the model" in str(err.value)

"""The import paths plug-ins and trainers used before the house was grouped by stage keep working for one
release, warn, and give the moved objects themselves (not copies)."""

from __future__ import annotations

import importlib
import sys

import pytest


def _fresh_import(name: str):
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[loaded]
    return importlib.import_module(name)


def test_beam_rl_reader_warns_and_is_the_trainers_reader():
    from beam_rl.trainer import reader

    with pytest.warns(DeprecationWarning, match="beam_rl.trainer.reader"):
        old = _fresh_import("beam_rl.reader")
    assert old.StepReader is reader.StepReader
    assert set(old.__all__) == set(reader.__all__)


def test_beam_rl_training_and_its_modules_warn_and_are_the_moved_modules():
    from beam_rl.trainer import checkpoint, policy_loss, reference

    with pytest.warns(DeprecationWarning, match="beam_rl.trainer"):
        old = _fresh_import("beam_rl.training")
    assert old.publish_weights is checkpoint.publish_weights
    assert old.ReferenceTrainer is reference.ReferenceTrainer
    from beam_rl.training.policy_loss import clipped_policy_loss
    from beam_rl.training.trainer import run_trainer

    assert clipped_policy_loss is policy_loss.clipped_policy_loss
    assert run_trainer is reference.run_trainer


def test_the_environment_api_still_offers_the_clients_types():
    from beam_rl.envs import base
    from beam_rl.inference import types

    assert base.Completion is types.Completion
    assert base.SamplingParams is types.SamplingParams
    assert base.CompletionClient is types.CompletionClient

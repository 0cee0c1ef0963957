"""The rollout graph's shape where it decides what crosses the runner: no Flatten anywhere (one after Score
had Prism unfuse the stage after it, so every scored group was pickled and crossed the runner twice), and
each shard's end of input on the rollouts' own output."""

from __future__ import annotations

import apache_beam as beam
from apache_beam.portability import common_urns

from beam_rl.config import config_from_dict
from beam_rl.job.graph import build_rollout_pipeline
from beam_rl.source import SourceSpec


def test_scored_groups_and_the_end_of_input_reach_the_packer_through_no_flatten(tmp_path):
    config = config_from_dict({"run": {"dir": str(tmp_path)}, "envs": [{"name": "reverse_text", "group_size": 2}]})
    spec = SourceSpec(
        config=config, server_urls=(), run_dir=str(tmp_path), run_id="run", with_trainer=False, schedule_groups=4
    )
    pipeline = beam.Pipeline()
    build_rollout_pipeline(pipeline, spec)
    transforms = pipeline.to_runner_api().components.transforms.values()
    assert not [t.unique_name for t in transforms if t.spec.urn == common_urns.primitives.FLATTEN.urn]
    dispatch = [
        t for t in transforms if t.unique_name.startswith("Dispatch/ParDo(_DispatchFn)") and not t.subtransforms
    ]
    assert dispatch and all(len(t.outputs) == 1 for t in dispatch)

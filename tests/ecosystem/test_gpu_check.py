"""scripts/gpu-check.sh --cpu-dry-run: the GPU check's every part, on the CPU with tiny sizes, so it cannot rot
between the rare days a GPU machine is lent (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess

from tests.support.paths import REPO


# Every figure docs/gpu.md reports, part by part.
EXPECTED = {
    "environment": {"python", "torch", "transformers", "cuda_available", "gpu"},
    "trainer": {"reference_cpu_float32", "device_float32", "device_bfloat16", "tolerance"},
    "large_model": {"parameters", "dtype", "build_s", "steps", "peak_memory_gib"},
    "data_parallel": {"backend", "max_abs_diff_to_reference_trainer"},
    "lora": {"trainable_parameters", "files", "steps"},
    "server": {"max_tokens", "throughput", "reload_weights_s", "after_reload", "lora"},
}
DEVICE_RUN = {"loss", "grad_norm", "tokens", "compute_s", "publish_s", "logprob_max_abs_diff", "loss_abs_diff",
              "within_tolerance", "published_weights_bit_exact"}


def test_the_cpu_dry_run_fills_every_field_of_every_part(tmp_path):
    done = subprocess.run(["scripts/gpu-check.sh", "--cpu-dry-run"], cwd=REPO, env={**os.environ, "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "gpu-check.json").read_text())
    assert (tmp_path / "gpu-check.log").stat().st_size > 0
    assert results["device"] == "cpu" and results["dry_run"] is True
    assert set(results["parts"]) == set(EXPECTED)
    for name, keys in EXPECTED.items():
        part = results["parts"][name]
        assert part["ok"] is True, (name, part)
        assert keys | {"ok", "wall_s"} <= set(part), (name, sorted(keys - set(part)))
    trainer = results["parts"]["trainer"]
    for run in ("device_float32", "device_bfloat16"):
        assert DEVICE_RUN <= set(trainer[run]), (run, sorted(DEVICE_RUN - set(trainer[run])))
        assert trainer[run]["within_tolerance"] and trainer[run]["published_weights_bit_exact"]
    assert trainer["device_float32"]["logprob_max_abs_diff"] == 0.0  # the same kernels on the same device
    assert results["parts"]["data_parallel"]["max_abs_diff_to_reference_trainer"] == 0.0
    assert [s["step"] for s in results["parts"]["large_model"]["steps"]] == [1, 2]
    server = results["parts"]["server"]
    assert sorted(int(n) for n in server["throughput"]) == [1, 16, 64]
    for n, figures in server["throughput"].items():
        # ignore_eos: every sequence runs to max_tokens, so the count is exact
        assert figures["tokens"] == int(n) * server["max_tokens"] and figures["tokens_per_s"] > 0
    assert server["lora"]["generation"]["tokens"] == 4 * 8 and server["after_reload"]["tokens"] == 4 * 8

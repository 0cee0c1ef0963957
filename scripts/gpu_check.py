"""The GPU check (`scripts/gpu-check.sh`): the trainer, a data-parallel rank, a LoRA adapter and the model-mode
stand-in server on CUDA, checked against the CPU, with results as JSON.

- Every part runs even when one before it failed; each records `ok` and, on failure, a one-line `error`.
- Correctness: the CUDA trainer's first step on a fixed batch (the committed fixture run) against the CPU
  trainer's, within stated tolerances; published weights read back bit for bit.
- `--cpu-dry-run` runs the same parts on the CPU with tiny sizes, so CI keeps the check from rotting.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from beam_rl.config import LoraSection, TrainerSection
from beam_rl.rundir import RunDir
from beam_rl.model.tiny import TINY_ARCH, tiny_model_dir, write_random_qwen2
from beam_rl.trainer.policy_loss import sampled_token_logprobs
from beam_rl.trainer.reader import StepReader
from beam_rl.trainer.reference import ReferenceTrainer

REPO = Path(__file__).resolve().parent.parent
FIXTURE_RUN = REPO / "tests" / "fixtures" / "run-beam-2.62"  # two committed steps of the tiny model, one rank

# The larger model: the tiny one's architecture and vocabulary, ~0.5B parameters on a GPU.
LARGE_ARCH = dict(TINY_ARCH, hidden_size=1280, num_hidden_layers=24, num_attention_heads=20, num_key_value_heads=4,
                  intermediate_size=4352)
DRY_RUN_ARCH = dict(TINY_ARCH, hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                    intermediate_size=512)

# Tolerances of the device trainer against the CPU trainer on the same batch (float32 on the CPU as reference):
# float32 differs only by kernel order; bfloat16 keeps 8 bits of mantissa, so logprobs of magnitude ~7 (the tiny
# vocabulary's log-size) move by a few hundredths at most (0.004 on the CPU's bfloat16 kernels).
TOLERANCE = {
    "float32": {"logprob_abs": 1e-3, "loss_abs": 1e-4},
    "bfloat16": {"logprob_abs": 0.1, "loss_abs": 1e-2},
}
SERVER_SEQUENCES = (1, 16, 64)
RESULT_FILE = "gpu-check.json"
LOG_FILE = "gpu-check.log"

log = logging.getLogger("gpu-check")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu-check.json and gpu-check.log")
    parser.add_argument("--cpu-dry-run", action="store_true", help="every part on the CPU with tiny sizes")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        handlers=[logging.FileHandler(out / LOG_FILE, mode="w"), logging.StreamHandler()])
    device = "cpu" if args.cpu_dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        log.error("no CUDA device: run with --cpu-dry-run on a machine without a GPU")
        return 2
    # A dry run shares a small machine: one thread, as intra-op threads spin against busy cores.
    torch.set_num_threads(1 if args.cpu_dry_run else min(torch.get_num_threads(), 8))
    with tempfile.TemporaryDirectory(prefix="beam-rl-gpu-check-") as scratch:
        check = GpuCheck(Path(scratch), device, dry_run=args.cpu_dry_run)
        results = check.run()
    (out / RESULT_FILE).write_text(json.dumps(results, indent=2) + "\n")
    failed = [name for name, part in results["parts"].items() if not part["ok"]]
    log.info("%s in %.1f s; %s", out / RESULT_FILE, results["wall_s"],
             f"failed: {', '.join(failed)}" if failed else "every part ok")
    return 1 if failed else 0


class GpuCheck:
    """The parts, in order; later parts reuse what earlier ones published (models, weights, adapters)."""

    def __init__(self, scratch: Path, device: str, dry_run: bool) -> None:
        self.scratch, self.device, self.dry_run = scratch, device, dry_run
        self.large_dtype = "float32" if dry_run else "bfloat16"  # bfloat16 on a CPU is slow and tests nothing new
        self.tiny_model = tiny_model_dir(0, cache_dir=scratch / "cache")
        self.large_model: Path | None = None
        self.large_weights: Path | None = None  # weights/step_1 published by the large trainer
        self.adapter: Path | None = None  # weights/step_1 of the LoRA trainer
        self.reference_weights: Path | None = None  # the device float32 trainer's weights/step_1

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        parts: dict[str, dict[str, Any]] = {}
        for name, part in [("environment", self.environment), ("trainer", self.trainer),
                           ("large_model", self.large_trainer), ("data_parallel", self.data_parallel),
                           ("lora", self.lora), ("server", self.server)]:
            parts[name] = _timed(name, part)
        return {"device": self.device, "dry_run": self.dry_run, "wall_s": round(time.monotonic() - started, 2),
                "parts": parts}

    # -- parts -----------------------------------------------------------------------------------------

    def environment(self) -> dict[str, Any]:
        import transformers

        cuda = torch.cuda.is_available()
        return {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
                "gpu": torch.cuda.get_device_name(0) if cuda else None,
                "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None}

    def trainer(self) -> dict[str, Any]:
        """Step 1 of the fixture run on the CPU in float32, then on the device in float32 and bfloat16."""
        reference = _train_first_step(self._run_copy("cpu-f32"), self.tiny_model, TrainerSection(device="cpu"))
        result: dict[str, Any] = {"reference_cpu_float32": _summary(reference), "tolerance": TOLERANCE}
        ok = True
        for dtype in ("float32", "bfloat16"):
            run = self._run_copy(f"{self.device}-{dtype}")
            trained = _train_first_step(run, self.tiny_model, TrainerSection(device=self.device, dtype=dtype))
            logprob_diff = float((trained["logprobs"] - reference["logprobs"]).abs().max())
            loss_diff = abs(trained["metrics"]["loss"] - reference["metrics"]["loss"])
            within = (logprob_diff <= TOLERANCE[dtype]["logprob_abs"] and loss_diff <= TOLERANCE[dtype]["loss_abs"])
            bit_exact = _published_equals_model(run, 1, trained["trainer"].model)
            result[f"device_{dtype}"] = {**_summary(trained), "logprob_max_abs_diff": logprob_diff,
                                                 "loss_abs_diff": loss_diff, "within_tolerance": within,
                                                 "published_weights_bit_exact": bit_exact}
            ok = ok and within and bit_exact
            if dtype == "float32":
                self.reference_weights = run.weights_path(1)
        result["ok"] = ok
        return result

    def large_trainer(self) -> dict[str, Any]:
        """A larger random-init model of the same architecture: both fixture steps, timed, peak memory."""
        arch = DRY_RUN_ARCH if self.dry_run else LARGE_ARCH
        built = time.monotonic()
        self.large_model = write_random_qwen2(self.scratch / "large-model", arch, seed=0, device=self.device,
                                              dtype=self.large_dtype)
        build_s = time.monotonic() - built
        run = self._run_copy("large")
        _reset_peak_memory()
        trainer = ReferenceTrainer(run, self.large_model, TrainerSection(device=self.device, dtype=self.large_dtype))
        steps = trainer.train(2)
        self.large_weights = run.weights_path(1)
        params = sum(p.numel() for p in trainer.model.parameters())
        return {"ok": len(steps) == 2 and _published_equals_model(run, 2, trainer.model), "parameters": params,
                "dtype": self.large_dtype, "build_s": round(build_s, 2), "steps": [_step_figures(m) for m in steps],
                "peak_memory_gib": _peak_memory_gib()}

    def data_parallel(self) -> dict[str, Any]:
        """One rank of the data-parallel trainer (NCCL on CUDA, gloo on the CPU) against the reference trainer."""
        from beam_rl.trainer.data_parallel import launch

        run = self._run_copy("data-parallel")
        launch(run.path, self.tiny_model, TrainerSection(device=self.device, nproc=1), max_steps=1, nproc=1)
        if self.reference_weights is None:
            raise RuntimeError("the trainer part published no reference weights to compare with")
        diff = _max_weight_diff(run.weights_path(1), self.reference_weights)
        return {"ok": diff == 0.0, "backend": "nccl" if self.device == "cuda" else "gloo",
                "max_abs_diff_to_reference_trainer": diff}

    def lora(self) -> dict[str, Any]:
        """A LoRA adapter over the larger model, trained one step and published."""
        if self.large_model is None:
            raise RuntimeError("the large_model part built no model")
        run = self._run_copy("lora")
        config = TrainerSection(device=self.device, dtype=self.large_dtype, lora=LoraSection(rank=16, alpha=32.0))
        trainer = ReferenceTrainer(run, self.large_model, config)
        steps = trainer.train(1)
        self.adapter = run.weights_path(1)
        files = sorted(p.name for p in self.adapter.iterdir())
        trainable = sum(p.numel() for p in trainer.parameters)
        return {"ok": "adapter_model.safetensors" in files and _published_equals_model(run, 1, trainer.model),
                "trainable_parameters": trainable, "files": files, "steps": [_step_figures(m) for m in steps]}

    def server(self) -> dict[str, Any]:
        """The model-mode stand-in server on the device: tokens/s at 1, 16 and 64 sequences, then a whole-weights
        reload and a LoRA load, each timed and followed by a generation."""
        from beam_rl.standin.server import EmbeddedServer

        if self.large_model is None or self.large_weights is None:
            raise RuntimeError("the large_model part published no weights to reload")
        server = EmbeddedServer(self.large_model, mode="model", max_num_seqs=max(SERVER_SEQUENCES), enable_lora=True,
                                torch_threads=None, device=self.device, dtype=self.large_dtype)
        server.start()
        try:
            http = _Http(server.url)
            max_tokens = 16 if self.dry_run else 128
            _generate(http, server.served_model_name, 1, 4)  # warm-up: first kernels, allocator
            throughput = {str(n): _generate(http, server.served_model_name, n, max_tokens) for n in SERVER_SEQUENCES}
            reload_s = _timed_post(http, "/collective_rpc", {"method": "reload_weights",
                                                             "kwargs": {"weights_path": str(self.large_weights)}})
            after_reload = _generate(http, server.served_model_name, 4, 8)
            lora = None
            if self.adapter is not None:
                lora_s = _timed_post(http, "/v1/load_lora_adapter", {"lora_name": "step1", "lora_path": str(self.adapter)})
                lora = {"load_s": lora_s, "generation": _generate(http, "step1", 4, 8)}
        finally:
            server.stop()
        ok = all(t["tokens"] > 0 for t in throughput.values()) and after_reload["tokens"] > 0 and lora is not None
        return {"ok": ok, "max_tokens": max_tokens, "throughput": throughput, "reload_weights_s": reload_s,
                "after_reload": after_reload, "lora": lora}

    # -- helpers ---------------------------------------------------------------------------------------

    def _run_copy(self, name: str) -> RunDir:
        """A fresh copy of the fixture's committed steps: each trainer publishes into its own."""
        path = self.scratch / "runs" / name
        shutil.copytree(FIXTURE_RUN, path)
        return RunDir(path)


def _timed(name: str, part: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    log.info("%s ...", name)
    started = time.monotonic()
    try:
        result = part()
        result.setdefault("ok", True)
    except Exception as exc:  # one part's failure must not hide the others' figures
        log.error("%s failed:\n%s", name, traceback.format_exc())
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    result["wall_s"] = round(time.monotonic() - started, 2)
    log.info("%s: %s in %.1f s", name, "ok" if result["ok"] else "FAILED", result["wall_s"])
    return result


def _train_first_step(run: RunDir, model_dir: Path, config: TrainerSection) -> dict[str, Any]:
    """The logprobs of the first micro-batch before training, and step 1's metrics."""
    trainer = ReferenceTrainer(run, model_dir, config)
    batch = StepReader(run, 0).read_step(1)[0]
    with torch.no_grad():
        logprobs = sampled_token_logprobs(trainer.model, trainer.as_tensor(batch["input_ids"]),
                                          trainer.as_tensor(batch["position_ids"]),
                                          trainer.as_tensor(batch["temperatures"])).float().cpu()
    metrics = trainer.train_step(1)
    return {"trainer": trainer, "logprobs": logprobs, "metrics": metrics}


def _summary(trained: dict[str, Any]) -> dict[str, Any]:
    return {"loss": trained["metrics"]["loss"], "grad_norm": trained["metrics"]["grad_norm"],
            **_step_figures(trained["metrics"])}


def _step_figures(metrics: dict[str, Any]) -> dict[str, Any]:
    return {key: metrics[key] for key in ("step", "loss", "tokens", "compute_s", "publish_s")}


def _published_equals_model(run: RunDir, step: int, model: torch.nn.Module) -> bool:
    """Every tensor of weights/step_<step>/ equals the model's own, bit for bit (peft: the adapter's)."""
    from safetensors.torch import load_file

    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict

        live = get_peft_model_state_dict(model)
    else:
        live = model.state_dict()
    published: dict[str, torch.Tensor] = {}
    for file in sorted(run.weights_path(step).glob("*.safetensors")):
        published.update(load_file(str(file)))
    return bool(published) and all(
        name in live and torch.equal(tensor, live[name].detach().cpu()) for name, tensor in published.items()
    )


def _max_weight_diff(left: Path, right: Path) -> float:
    from safetensors.torch import load_file

    a = {k: v for f in sorted(left.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    b = {k: v for f in sorted(right.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    if a.keys() != b.keys():
        raise ValueError(f"{left} and {right} hold different tensors")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


class _Http:
    """JSON over HTTP with the standard library: the GPU machine's image has no httpx."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """The answer's JSON, or its text where it is not JSON (vLLM's LoRA routes answer plain text)."""
        import urllib.request

        request = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:  # raises HTTPError on 4xx/5xx
            payload = response.read()
            is_json = response.headers.get_content_type() == "application/json"
        return json.loads(payload) if is_json else payload.decode()


def _generate(http: _Http, model: str, n: int, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": [1, 2, 3, 4, 5, 6, 7, 8], "n": n, "max_tokens": max_tokens, "temperature": 1.0,
            "seed": n, "ignore_eos": True, "return_token_ids": True}
    started = time.monotonic()
    answer = http.post("/v1/completions", body)
    elapsed = time.monotonic() - started
    tokens = sum(len(choice["token_ids"]) for choice in answer["choices"])
    return {"sequences": n, "tokens": tokens, "wall_s": round(elapsed, 4), "tokens_per_s": round(tokens / elapsed, 1)}


def _timed_post(http: _Http, path: str, body: dict[str, Any]) -> float:
    started = time.monotonic()
    http.post(path, body)
    return round(time.monotonic() - started, 4)


def _reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_memory_gib() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


if __name__ == "__main__":
    raise SystemExit(main())

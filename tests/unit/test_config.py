"""The run config: defaults, TOML loading, readable errors that name the key path, and cross-field checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from beam_rl.config import ConfigError, RunConfig, config_from_dict, load_config
from tests.support.paths import REPO

MINIMAL = '[[envs]]\nname = "arithmetic"\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def problems_of(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    return info.value


def test_minimal_config_takes_the_tiny_cpu_defaults(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.run.dir == Path("runs/tiny") and cfg.run.seed == 0 and cfg.run.max_steps == 10
    assert cfg.run.bad_rows == "fail"
    assert (cfg.model.name, cfg.model.max_context) == ("tiny", 512)
    assert cfg.inference.urls == [] and cfg.inference.embedded_servers == 2
    assert cfg.inference.max_inflight == 128 and cfg.inference.max_tokens == 24
    env = cfg.envs[0]
    assert (env.name, env.group_size, env.algorithm, env.mode, env.epochs) == ("arithmetic", 8, "grpo", "group", 1)
    assert env.algorithm_args == {}
    assert (cfg.batch.rollouts_per_step, cfg.batch.seq_len, cfg.batch.token_budget) == (64, 1024, None)
    assert cfg.filters.zero_advantage.mode == "enforce"
    assert {cfg.filters.gibberish.mode, cfg.filters.repetition.mode, cfg.filters.overlong.mode} == {"monitor"}
    assert (cfg.off_policy.max_async_level, cfg.off_policy.max_off_policy_steps) == (1, 2)
    assert cfg.runner.name == "direct" and cfg.runner.flink_master is None
    assert cfg.trainer.kind == "reference" and cfg.eval.every_steps == 0


def _keys(data: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in data.items():
        keys.add(prefix + key)
        if isinstance(value, dict) and key not in ("algorithm_args", "args"):
            keys |= _keys(value, f"{prefix}{key}.")
    return keys


def test_example_config_is_valid_and_spells_out_every_section():
    import tomllib

    cfg = load_config(REPO / "configs" / "tiny.toml")
    written = tomllib.loads((REPO / "configs" / "tiny.toml").read_text())
    dumped = cfg.model_dump(mode="json")
    env_keys = set(dumped.pop("envs")[0])
    # Every key but the optional ones (left commented out, with their meaning) is written out.
    optional = {"batch.token_budget", "runner.flink_master", "runner.checkpointing_interval_ms",
                "runner.state_backend", "runner.state_backend_storage_path",
                "runner.environment", "runner.worker_pool", "runner.worker_command", "runner.flink_local_heap_mb",
                "inference.api_key_env", "inference.ca_bundle", "inference.dns_name", "inference.dns_resolver",
                "dispatch.concurrency.start", "trainer.lora"}
    assert _keys(dumped) - optional <= _keys({k: v for k, v in written.items() if k != "envs"})
    env_optional = {"limit", "args", "kind", "curriculum", "ratio"}
    assert env_keys - env_optional <= set(written["envs"][0])
    # ... and the optional ones are there too, commented out, so the file shows every key.
    text = (REPO / "configs" / "tiny.toml").read_text()
    commented = {line.lstrip("# ").split(" ")[0] for line in text.splitlines() if line.startswith("# ")}
    missing = {key for key in optional | env_optional if key.rsplit(".", 1)[-1] not in commented
               and f"# [{key}]" not in text and f"# [envs.{key}]" not in text}
    assert not missing, f"configs/tiny.toml does not show {sorted(missing)}"


def test_model_dump_to_json_loads_back_to_the_same_config(tmp_path):
    toml_text = MINIMAL + '[run]\ndir = "/tmp/x"\n[runner]\nname = "flink"\nflink_master = "h:8081"\n'
    cfg = load_config(write(tmp_path, toml_text))
    text = json.dumps(cfg.model_dump(mode="json"))
    assert config_from_dict(json.loads(text)) == cfg
    assert json.loads(text)["run"]["dir"] == "/tmp/x"


def test_unknown_key_names_file_path_and_the_key_it_resembles(tmp_path):
    err = problems_of(tmp_path, MINIMAL + "[batch]\nseq_lenn = 256\n")
    assert str(tmp_path / "run.toml") in str(err)
    assert err.problems == [("batch.seq_lenn", "unknown key (did you mean 'seq_len'?)")]


def test_unknown_key_in_an_env_names_its_index(tmp_path):
    err = problems_of(tmp_path, MINIMAL + '[[envs]]\nname = "b"\ngroupsize = 4\n')
    assert [p for p, _ in err.problems] == ["envs[1].groupsize"]


def test_unknown_section_lists_the_allowed_ones_when_nothing_is_close(tmp_path):
    err = problems_of(tmp_path, MINIMAL + "[zzz]\nx = 1\n")
    (path, msg), = err.problems
    assert path == "zzz" and "allowed:" in msg and "off_policy" in msg


def test_wrong_types_are_errors_not_coercions(tmp_path):
    err = problems_of(tmp_path, MINIMAL + '[batch]\nseq_len = "1024"\n[run]\nseed = true\n')
    messages = dict(err.problems)
    assert set(messages) == {"batch.seq_len", "run.seed"}
    assert "valid integer" in messages["batch.seq_len"] and "'1024'" in messages["batch.seq_len"]


def test_an_integer_is_a_valid_float(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL + "[inference]\ntemperature = 1\nrequest_timeout_s = 5\n"))
    assert cfg.inference.temperature == 1.0 and cfg.inference.request_timeout_s == 5.0


def test_impossible_values_are_all_reported_with_their_paths(tmp_path):
    err = problems_of(
        tmp_path,
        '[[envs]]\nname = "a"\ngroup_size = 0\nmode = "sometimes"\n'
        "[batch]\nseq_len = 0\n[inference]\ntemperature = -1.0\n[off_policy]\nmax_async_level = -1\n",
    )
    messages = dict(err.problems)
    assert messages["batch.seq_len"] == "Input should be greater than 0 (got 0)"
    assert messages["envs[0].group_size"] == "Input should be greater than or equal to 1 (got 0)"
    assert "'group' or 'rollout'" in messages["envs[0].mode"]
    assert set(messages) == {
        "batch.seq_len", "envs[0].group_size", "envs[0].mode", "inference.temperature", "off_policy.max_async_level"
    }
    assert "  batch.seq_len: Input should be greater than 0 (got 0)" in str(err).splitlines()


def test_at_least_one_env_is_required(tmp_path):
    assert problems_of(tmp_path, "[run]\nseed = 1\n").problems == [("envs", "required key is missing")]
    with pytest.raises(ConfigError, match="envs: List should have at least 1 item"):
        config_from_dict({"envs": []})


def test_inference_urls_must_be_http_and_lose_their_trailing_slash():
    cfg = config_from_dict({"envs": [{"name": "a"}], "inference": {"urls": ["http://h:8000/", "https://g"]}})
    assert cfg.inference.urls == ["http://h:8000", "https://g"]
    with pytest.raises(ConfigError, match=r"inference.urls: .*'h:8000' is not an http\(s\) base URL"):
        config_from_dict({"envs": [{"name": "a"}], "inference": {"urls": ["h:8000"]}})


def test_toml_syntax_error_names_the_file_and_line(tmp_path):
    err = problems_of(tmp_path, MINIMAL + "[batch\n")
    assert str(tmp_path / "run.toml") in str(err) and "not valid TOML" in str(err) and "line 3" in str(err)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml")


# -- cross-field checks -----------------------------------------------------------------------------


def check(**sections) -> list[tuple[str, str]]:
    data = {"envs": [{"name": "a"}], **sections}
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    return info.value.problems


def test_rollouts_per_step_must_be_a_multiple_of_every_group_size():
    envs = [{"name": "a", "group_size": 8}, {"name": "b", "group_size": 6}]
    (path, msg), = check(envs=envs, batch={"rollouts_per_step": 64})
    assert path == "batch.rollouts_per_step" and "envs[1].group_size (6, env 'b')" in msg
    assert config_from_dict({"envs": envs, "batch": {"rollouts_per_step": 48}}).batch.rollouts_per_step == 48


def test_max_off_policy_steps_must_cover_max_async_level():
    (path, _), = check(off_policy={"max_async_level": 3, "max_off_policy_steps": 2})
    assert path == "off_policy.max_off_policy_steps"
    cfg = config_from_dict({"envs": [{"name": "a"}], "off_policy": {"max_async_level": 2}})
    assert cfg.off_policy.max_async_level == 2


def test_flink_needs_a_master_and_flink_local_does_not():
    assert [p for p, _ in check(runner={"name": "flink"})] == ["runner.flink_master"]
    assert "flink-local" in check(runner={"name": "flink", "flink_master": "[local]"})[0][1]
    assert config_from_dict({"envs": [{"name": "a"}], "runner": {"name": "flink-local"}}).runner.flink_master is None


def test_state_backend_needs_a_storage_path():
    assert [p for p, _ in check(runner={"state_backend": "rocksdb"})] == ["runner.state_backend_storage_path"]


def test_env_names_are_unique():
    (path, msg), = check(envs=[{"name": "a"}, {"name": "a"}])
    assert path == "envs[1].name" and "envs[0]" in msg


def test_group_mode_needs_enough_permits_for_a_whole_group():
    (path, _), = check(envs=[{"name": "a", "group_size": 16}], inference={"max_inflight": 8})
    assert path == "inference.max_inflight"
    cfg = config_from_dict(
        {"envs": [{"name": "a", "group_size": 16, "mode": "rollout"}], "inference": {"max_inflight": 8}}
    )
    assert cfg.inference.max_inflight == 8


def test_a_trajectory_must_fit_a_micro_batch_and_leave_room_for_a_prompt():
    paths = [p for p, _ in check(model={"max_context": 2048}, inference={"max_tokens": 4096})]
    assert paths == ["inference.max_tokens", "batch.seq_len"]


def test_embedded_servers_may_be_zero_only_with_urls():
    assert [p for p, _ in check(inference={"embedded_servers": 0})] == ["inference.embedded_servers"]
    cfg = config_from_dict({"envs": [{"name": "a"}], "inference": {"embedded_servers": 0, "urls": ["http://h"]}})
    assert cfg.inference.embedded_servers == 0


def test_env_lookup_by_name():
    cfg = config_from_dict({"envs": [{"name": "a"}, {"name": "b", "group_size": 4}]})
    assert cfg.env("b").group_size == 4
    with pytest.raises(KeyError, match="no environment 'c'"):
        cfg.env("c")
    assert isinstance(cfg, RunConfig)


def test_trainer_section_defaults_and_ratio_clip_bounds(tmp_path):
    trainer = load_config(write(tmp_path, MINIMAL)).trainer
    assert (trainer.lr, trainer.weight_decay, trainer.max_grad_norm) == (1e-3, 0.0, 1.0)
    assert (trainer.clip_eps_low, trainer.clip_eps_high) == (0.2, 0.2)
    err = problems_of(tmp_path, MINIMAL + "[trainer]\nclip_eps_low = 1.0\nmax_grad_norm = 0.0\n")
    assert [path for path, _ in err.problems] == ["trainer.clip_eps_low", "trainer.max_grad_norm"]


def test_weight_update_modes_and_secured_server_settings_are_checked(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    assert (cfg.weights.update_mode, cfg.inference.stream, cfg.inference.max_redispatches) == ("keep", True, 3)
    assert cfg.off_policy.max_regenerations == 2 and cfg.inference.api_key_env is None
    err = problems_of(tmp_path, MINIMAL + '[weights]\nupdate_mode = "pause"\n')
    assert "weights.update_mode" in str(err) and "'reload', 'keep' or 'continue'" in str(err)
    err = problems_of(tmp_path, MINIMAL + f'[inference]\nca_bundle = "{tmp_path}/missing.pem"\n')
    assert "inference.ca_bundle" in str(err) and "is not a file" in str(err)
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    cfg = load_config(write(tmp_path, MINIMAL + f'[inference]\nca_bundle = "{tmp_path}/ca.pem"\n'
                                                'api_key_env = "VLLM_API_KEY"\n'))
    assert cfg.inference.ca_bundle == tmp_path / "ca.pem"
    assert "VLLM_API_KEY" in json.dumps(cfg.model_dump(mode="json"))  # the variable's name, never a key


def test_the_advantage_algorithm_and_its_arguments_are_checked_when_the_config_loads(tmp_path):
    """A name nobody registered, a parameter the algorithm does not take, a value of the wrong type or one
    it cannot compute with: each a problem at its key, before any pipeline could meet it while scoring."""
    cases = {
        'algorithm = "gpro"': ("envs[0].algorithm", "unknown advantage algorithm 'gpro'; registered: ['dr_grpo', "
                                                    "'grpo', 'maxrl', 'reinforce_plus_plus_baseline', 'rloo']"),
        'algorithm_args = {epsilon = 1e-4}': ("envs[0].algorithm_args.epsilon", "'grpo' takes no parameter "
                                              "'epsilon'; it takes ['eps', 'unbiased_std']"),
        'algorithm_args = {eps = "1e-4"}': ("envs[0].algorithm_args.eps", "expected a number (the default is "
                                            "1e-06), got '1e-4'"),
        'algorithm_args = {unbiased_std = 1}': ("envs[0].algorithm_args.unbiased_std", "expected true or false "
                                                "(the default is True), got 1"),
        'algorithm = "reinforce_plus_plus_baseline"\nalgorithm_args = {whiten_eps = [1]}': (
            "envs[0].algorithm_args.whiten_eps", "expected a number (the default is 1e-08), got [1]"),
        'algorithm_args = {eps = 0.0}': ("envs[0].algorithm_args", "'grpo' cannot score a group with {'eps': 0.0}: "
                                         "rewards [0.5, 0.5, 0.5] give advantages [nan, nan, nan]"),
    }
    for line, problem in cases.items():
        err = problems_of(tmp_path, f'[[envs]]\nname = "arithmetic"\n{line}\n')
        assert err.problems == [problem], line
    cfg = load_config(write(tmp_path, '[[envs]]\nname = "arithmetic"\nalgorithm = "rloo"\n'
                                      '[[envs]]\nname = "b"\nalgorithm_args = {eps = 1, unbiased_std = false}\n'))
    assert [e.algorithm_args for e in cfg.envs] == [{}, {"eps": 1, "unbiased_std": False}]


def test_dns_discovery_needs_a_base_url_to_resolve(tmp_path):
    assert "needs dns_name" in str(problems_of(tmp_path, MINIMAL + '[inference]\ndiscovery = "dns"\n'))
    assert "is not an http(s) base URL" in str(problems_of(
        tmp_path, MINIMAL + '[inference]\ndiscovery = "dns"\ndns_name = "vllm.svc:8000"\n'))
    assert "set discovery" in str(problems_of(tmp_path, MINIMAL + '[inference]\ndns_name = "http://vllm.svc:8000"\n'))


def test_streamed_chunks_are_asked_for_only_where_an_update_cannot_hide_their_cut():
    """Keep updates on the completions route stream a token an event (vLLM holds a partial chunk through the
    pause); elsewhere the clients ask for inference.stream_interval tokens a chunk."""
    from beam_rl import wiring

    def client_interval(**sections: dict) -> int:
        config = config_from_dict({"envs": [{"name": "a"}], **sections})
        return wiring.inference_client(config, "http://h:8000", None).stream_interval

    assert client_interval() == 1  # the defaults: keep, completions
    assert client_interval(inference={"route": "generate"}) == 16
    assert client_interval(weights={"update_mode": "continue"}) == 16
    assert client_interval(weights={"update_mode": "reload"}, inference={"stream_interval": 4}) == 4
    with pytest.raises(ConfigError, match="stream_interval"):
        config_from_dict({"envs": [{"name": "a"}], "inference": {"stream_interval": 0}})

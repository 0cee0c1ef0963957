"""A living fleet, below the pipeline: the servers file and `beam-rl servers`, DNS discovery against a
nameserver the test runs on loopback, how servers are dealt to dispatch shards as the fleet changes, and
the launcher's keeper refusing servers that cannot join (tests/integration/test_dispatch_embedded.py drives joins and
drains through the dispatcher; tests/pipeline/test_faults.py through the whole pipeline)."""

from __future__ import annotations

import json
import logging
import random
import socket
from collections import Counter
from pathlib import Path

import pytest

from beam_rl.wiring import job_parts
from beam_rl import cli
from beam_rl.config import config_from_dict
from beam_rl.fleet.assignment import Fleet, FleetFollower, deal
from beam_rl.fleet.discovery import DiscoveryError, ServersFile
from beam_rl.fleet.dns_fleet import resolve_fleet
from beam_rl.job.fleet_keeper import FleetKeeper, initial_fleet
from beam_rl.rundir import RunDir
from beam_rl.rundir.failures import ServersNotReadyError
from tests.support.dns_server import LoopbackDNS

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def nameserver():
    server = LoopbackDNS()
    yield server
    server.close()


def _config(run_dir, shards: int = 1, **inference):
    return config_from_dict({
        "run": {"dir": str(run_dir)},
        "envs": [{"name": "reverse_text", "group_size": 4}],
        "dispatch": {"shards": shards},
        "inference": {"embedded_mode": "instant", "discovery_interval_s": 0.2, "drain_timeout_s": 1.0, **inference},
    })


# -- the servers file ---------------------------------------------------------------------------------


def test_servers_file_edits_and_the_embedded_servers_it_replaces_on_a_restart(tmp_path):
    servers = ServersFile(tmp_path / "servers")
    assert servers.seed(["http://a:1", "http://b:1"], embedded=True) == ["http://a:1", "http://b:1"]
    assert servers.add("http://c:1/") and not servers.add("http://c:1")
    # A restart starts new embedded servers: they replace the old ones, what was added stays.
    assert servers.seed(["http://d:1"], embedded=True) == ["http://c:1", "http://d:1"]
    assert servers.remove("http://d:1") and not servers.remove("http://d:1")
    assert servers.seed(["http://e:1"], embedded=False) == ["http://c:1"]  # the file is the fleet
    with pytest.raises(ValueError, match="not an http"):
        servers.add("c:1")


def test_a_servers_file_that_does_not_parse_names_its_line(tmp_path):
    path = tmp_path / "servers"
    path.write_text("# the fleet\nhttp://a:1\n\nvllm-2:8000  # forgot the scheme\n")
    with pytest.raises(DiscoveryError, match=r"servers, line 4: 'vllm-2:8000' is not an http\(s\) base URL"):
        ServersFile(path).urls()


def test_beam_rl_servers_adds_removes_and_lists(tmp_path, capsys):
    ServersFile.of_run(tmp_path).seed(["http://127.0.0.1:9"], embedded=False)
    assert cli.main(["servers", "add", str(tmp_path), "http://127.0.0.1:10"]) == 0
    assert cli.main(["servers", "remove", str(tmp_path), "http://127.0.0.1:9"]) == 0
    assert cli.main(["servers", "list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "added to" in out and "removed from" in out and "http://127.0.0.1:10" in out
    assert ServersFile.of_run(tmp_path).urls() == ["http://127.0.0.1:10"]
    assert cli.main(["servers", "add", str(tmp_path)]) == 2  # no URL
    assert cli.main(["servers", "add", str(tmp_path), "127.0.0.1:11"]) == 2
    assert "not an http(s) base URL" in capsys.readouterr().out


# -- DNS ----------------------------------------------------------------------------------------------


def test_dns_discovery_follows_the_records(nameserver):
    nameserver.records["vllm.fleet.test"] = ["127.0.0.3", "127.0.0.2", "::1"]
    assert resolve_fleet("http://vllm.fleet.test:8000", nameserver.address) == [
        "http://127.0.0.2:8000", "http://127.0.0.3:8000", "http://[::1]:8000"]
    nameserver.records["vllm.fleet.test"] = ["127.0.0.4"]
    assert resolve_fleet("https://vllm.fleet.test:8443/", nameserver.address) == ["https://127.0.0.4:8443"]


def test_dns_discovery_errors_name_the_name_and_the_nameserver(nameserver):
    nxdomain = f"gone.test does not exist .NXDOMAIN from nameserver {nameserver.address}"
    with pytest.raises(DiscoveryError, match=nxdomain):
        resolve_fleet("http://gone.test:8000", nameserver.address)
    nameserver.records["empty.test"] = []
    with pytest.raises(DiscoveryError, match="empty.test resolves to no address"):
        resolve_fleet("http://empty.test:8000", nameserver.address)
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never answers
    silent.bind(("127.0.0.1", 0))
    try:
        with pytest.raises(DiscoveryError, match="did not answer"):
            resolve_fleet("http://vllm.test:8000", f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.3)
    finally:
        silent.close()


def test_the_keeper_follows_the_dns_records_and_keeps_the_fleet_when_the_name_goes(
        nameserver, start_embedded, tmp_path, caplog):
    first = start_embedded(mode="instant", host="127.0.0.2", served_model_name="tiny")
    second = start_embedded(mode="instant", host="127.0.0.3", port=first.port, served_model_name="tiny")
    nameserver.records["vllm.fleet.test"] = ["127.0.0.2"]
    config = _config(tmp_path, discovery="dns", dns_name=f"http://vllm.fleet.test:{first.port}",
                     dns_resolver=nameserver.address)
    start = initial_fleet(config, str(tmp_path), [])
    assert start == [first.url]
    keeper = FleetKeeper(job_parts(config), str(tmp_path), start)
    follower = FleetFollower(RunDir(tmp_path).fleet_path, 0)
    assert follower.changed(0.0) == [first.url]
    nameserver.records["vllm.fleet.test"] = ["127.0.0.2", "127.0.0.3"]
    keeper.tick()
    assert follower.changed(1e12) == [first.url, second.url]
    nameserver.records["vllm.fleet.test"] = ["127.0.0.3"]
    keeper.tick()
    assert follower.changed(1e12) == [second.url]
    del nameserver.records["vllm.fleet.test"]
    with caplog.at_level(logging.WARNING):
        keeper.tick()
        keeper.tick()
    assert follower.changed(1e12) is None  # unchanged
    said = [r.getMessage() for r in caplog.records if "does not exist" in r.getMessage()]
    assert len(said) == 1 and "the run keeps its 1 servers" in said[0]  # said once, not every discovery
    with pytest.raises(ServersNotReadyError, match="vllm.fleet.test does not exist"):
        initial_fleet(config, str(tmp_path), [])


# -- who may join ------------------------------------------------------------------------------------


class _OtherTokenizer:
    """A tokenizer that disagrees with the run's on every text."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [t + 1 for t in self._tokenizer.encode(text, add_special_tokens=add_special_tokens)]


def test_a_server_that_cannot_join_is_named_and_the_run_keeps_the_servers_it_has(start_embedded, tmp_path, caplog):
    good = start_embedded(mode="instant", served_model_name="tiny")
    other_model = start_embedded(mode="instant", served_model_name="llama-70b")
    other_tokenizer = start_embedded(mode="instant", served_model_name="tiny")
    other_tokenizer.tokenizer = _OtherTokenizer(other_tokenizer.tokenizer)
    newcomer = start_embedded(mode="instant", served_model_name="tiny")
    config = _config(tmp_path, discovery="file")
    servers = ServersFile.of_run(tmp_path)
    keeper = FleetKeeper(job_parts(config), str(tmp_path), servers.seed([good.url], embedded=False))
    for server in (other_model, other_tokenizer, newcomer):
        servers.add(server.url)
    servers.add("http://127.0.0.1:9")  # nothing listens there
    with caplog.at_level(logging.WARNING):
        fleet = keeper.tick()
    assert fleet.urls() == sorted([good.url, newcomer.url])
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert f"{other_model.url} serves ['llama-70b'], not the run's model 'tiny'" in said
    assert f"{other_tokenizer.url} tokenizes differently from the run's model 'tiny'" in said
    assert "http://127.0.0.1:9 does not answer /health yet" in said
    # A servers file that stops parsing leaves the fleet as it is.
    servers.path.write_text(servers.path.read_text() + "not a url\n")
    with caplog.at_level(logging.WARNING):
        assert keeper.tick() == fleet
    assert "line 6: 'not a url' is not an http(s) base URL" in caplog.text
    assert json.loads(RunDir(tmp_path).fleet_path.read_text())["generation"] == 2


# -- dealing to shards --------------------------------------------------------------------------------


def test_servers_are_dealt_to_shards_balanced_sticky_and_never_to_two_at_once():
    rng = random.Random(7)
    for shards in (1, 2, 3, 4):
        fleet, now, handoff = None, 0.0, 10.0
        pool = [f"http://10.0.0.{i}:8000" for i in range(40)]
        urls = set(rng.sample(pool, shards))
        for _ in range(200):
            now += rng.choice([1.0, 20.0])
            if rng.random() < 0.5 and len(urls) > 1:
                urls.discard(rng.choice(sorted(urls)))
            else:
                urls.add(rng.choice(pool))
            new = deal(fleet, urls, shards, now, handoff)
            assert set(new.urls()) == urls
            counts = Counter(p.shard for p in new.servers)
            assert max(counts.get(s, 0) for s in range(shards)) - min(counts.get(s, 0) for s in range(shards)) <= 1
            for placement in new.servers:
                old = fleet.placement(placement.url) if fleet else None
                if old is not None and old.shard != placement.shard:
                    # Moved: its new shard waits out the old one's drain.
                    assert placement.serve_from == now + handoff
                    assert placement.url not in new.of_shard(placement.shard, now)
                    assert placement.url in new.of_shard(placement.shard, now + handoff)
                elif old is not None:
                    assert placement == old  # stays where it is
            driven = [url for shard in range(shards) for url in new.of_shard(shard, now)]
            assert len(driven) == len(set(driven))
            fleet = new


def test_a_new_server_goes_to_the_shard_with_fewest_and_the_generation_counts_changes():
    fleet = deal(None, ["http://a:1", "http://b:1", "http://c:1"], 2, 0.0, 5.0)
    assert [(p.url, p.shard) for p in fleet.servers] == [("http://a:1", 0), ("http://b:1", 1), ("http://c:1", 0)]
    grown = deal(fleet, [*fleet.urls(), "http://d:1"], 2, 1.0, 5.0)
    assert grown.placement("http://d:1").shard == 1 and grown.generation == 2
    assert deal(grown, grown.urls(), 2, 2.0, 5.0) == grown  # nothing changed, nothing counted
    assert Fleet.read(Path("/nonexistent/fleet.json")) is None

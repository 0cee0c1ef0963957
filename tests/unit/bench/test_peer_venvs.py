"""A peer's own virtualenv (bench/peers/shims/venvs.py), built by a stand-in uv that records what it is asked:
built once, rebuilt when a pin or the index date changes, resolved as the index stood on the date given, and a
failed or overlong step named in one line."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from bench.peers.shims import venvs


@pytest.fixture
def fake_uv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A uv that appends its arguments to calls.txt, and fails when FAIL names its subcommand."""
    calls = tmp_path / "calls.txt"
    script = tmp_path / "uv"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n[ "$1" = "$FAIL" ] && {{ echo "no such pin" >&2; exit 1; }}\n'
                      '[ "$1" = "$SLOW" ] && sleep 5\nexit 0\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(venvs, "uv", lambda: str(script))
    monkeypatch.setenv("BEAM_RL_CACHE", str(tmp_path / "cache"))
    return calls


def test_a_venv_is_built_once_per_pins_and_index_date(fake_uv: Path) -> None:
    assert not venvs.is_built("p", ["a==1"])
    python = venvs.ensure_venv("p", ["a==1"], exclude_newer="2026-12-07T00:00:00Z")
    assert python == venvs.venv_python("p") and venvs.is_built("p", ["a==1"], "2026-12-07T00:00:00Z")
    venv_call, install_call = fake_uv.read_text().splitlines()
    assert venv_call.startswith("venv ") and install_call.startswith("pip install")
    assert install_call.endswith("--exclude-newer 2026-12-07T00:00:00Z a==1")
    venvs.ensure_venv("p", ["a==1"], exclude_newer="2026-12-07T00:00:00Z")
    assert len(fake_uv.read_text().splitlines()) == 2  # built already: nothing run
    assert not venvs.is_built("p", ["a==1"])  # another index date is another venv
    venvs.ensure_venv("p", ["a==2"])
    assert fake_uv.read_text().splitlines()[-1].endswith("--python " + str(venvs.venv_python("p")) + " a==2")


def test_a_failed_or_overlong_step_is_one_line_naming_the_peer_and_leaves_it_unbuilt(
    fake_uv: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAIL", "pip")
    with pytest.raises(RuntimeError, match=r"^peer 'p': `uv pip \.\.\.` failed: no such pin$"):
        venvs.ensure_venv("p", ["a==1"])
    assert not venvs.is_built("p", ["a==1"])
    monkeypatch.delenv("FAIL")
    monkeypatch.setenv("SLOW", "venv")
    with pytest.raises(RuntimeError, match=r"^peer 'p': `uv venv \.\.\.` took over 0.5 s$"):
        venvs.ensure_venv("p", ["a==1"], timeout_s=0.5)
    assert not venvs.is_built("p", ["a==1"])

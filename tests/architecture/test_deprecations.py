"""A deprecation warning raised from beam-rl's own modules fails the suite; one a library raises about itself
stays hidden (pytest.ini's filterwarnings). Checked by running pytest, with this checkout's pytest.ini, on a
tiny test file whose code warns as a module of each package would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TINY = '''
import pytest

@pytest.mark.parametrize("category", [DeprecationWarning, PendingDeprecationWarning])
@pytest.mark.parametrize("module", ["beam_rl.envs.old", "transforms.old", "runners", "schemas.old",
                                    "apache_beam.io.old", "beam_rl_lookalike"])
def test_warns_from(module, category):
    # Warnings are filtered by the module the warning comes from: here, code running as that module.
    exec("import warnings; warnings.warn('old API', category)", {"__name__": module, "category": category})
'''


def test_our_deprecation_warnings_fail_and_a_librarys_do_not(tmp_path: Path) -> None:
    (tmp_path / "test_tiny.py").write_text(TINY)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pytest.ini"), "--rootdir", str(tmp_path),
         "-p", "no:cacheprovider", "-o", "addopts=", "-q", "-rf", str(tmp_path / "test_tiny.py")],
        capture_output=True, text=True, cwd=tmp_path, timeout=120)
    failed = sorted(line.split("[", 1)[1].split("]", 1)[0] for line in run.stdout.splitlines()
                    if line.startswith("FAILED"))
    ours = ("beam_rl.envs.old", "transforms.old", "runners", "schemas.old")
    assert failed == sorted(f"{module}-{category}" for module in ours
                            for category in ("DeprecationWarning", "PendingDeprecationWarning")), run.stdout
    assert "8 failed, 4 passed" in run.stdout, run.stdout

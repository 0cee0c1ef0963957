"""Fetch or build the runner binaries that must match the installed Beam SDK exactly.

- Prism (the DirectRunner's engine): Beam would download it from GitHub releases, which this kind of
  machine cannot reach, so it is built from the Go module at the SDK's version, with the fixes in
  `runners/prism_patches/`, and cached.
- Flink job server: the shaded `beam-runners-flink-<flink>-job-server` jar is not served by the Maven
  registry reachable here, so it is assembled from the `beam-runners-flink-<flink>` runner artifact
  and its dependencies (resolved by Maven) as a launcher jar whose manifest names them. At 2.70.0 one
  of those dependencies, `beam-runners-java-job-service`, is not served: the 2.65.0 one is used
  (`_JOB_SERVER_POM` says why that works).
Both are cached under `$BEAM_RL_CACHE` (default `~/.cache/beam-rl`); a second call costs a stat.
`python -m runners.bootstrap prism --beam-version V` runs without Beam installed (with the system
python3), so the set-up script builds Prism while the virtualenv installs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from beam_rl.cache import cache_root

_LOG = logging.getLogger(__name__)

FLINK_VERSION = "1.19"  # the newest Flink whose runner artifact resolves at this Beam version
_FLINK_MAIN_CLASS = "org.apache.beam.runners.flink.FlinkJobServerDriver"


class BootstrapError(RuntimeError):
    """A runner prerequisite is missing; the message says what and how to get it."""


def sdk_version() -> str:
    """The installed Beam SDK's version: the one every runner binary must match."""
    from apache_beam.version import __version__

    return __version__


def require_tool(tool: str, how: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise BootstrapError(f"`{tool}` was not found on PATH; {how}")
    return path


def _run(
    cmd: list[str], what: str, env: dict[str, str] | None = None, cwd: Path | None = None, progress: bool = True
) -> str:
    """Run one step; with `progress`, log its start and how long it took (the set-up script shows both)."""
    log = _LOG.info if progress else _LOG.debug
    log("%s ...", what)
    _LOG.debug("%s", " ".join(cmd))
    started = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip()[-3000:]
        raise BootstrapError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    log("%s: %.0f s", what, time.monotonic() - started)
    return proc.stdout


PRISM_PATCHES = sorted((Path(__file__).parent / "prism_patches").glob("*.patch"))


def _patches_digest(patches: list[Path]) -> str:
    digest = hashlib.sha256()
    for patch in patches:
        digest.update(patch.name.encode() + b"\0" + patch.read_bytes())
    return digest.hexdigest()[:12]


def prism_path(version: str | None = None, patches: list[Path] | None = None) -> Path:
    """Where the Prism binary of `version` (default: the installed SDK's) with `patches` (default: all
    of ours) is cached."""
    version = version or sdk_version()
    digest = _patches_digest(PRISM_PATCHES if patches is None else patches)
    return cache_root() / "prism" / f"v{version}-{digest}" / "prism"


def ensure_prism(version: str | None = None, patches: list[Path] | None = None) -> Path:
    """The Prism binary for `version`, built on first use from Beam's Go module with our fixes applied
    (`runners/prism_patches/`, docs/runners.md). The cache path names the patches (`prism_path`), so
    changing them builds a new binary. `patches` selects a subset: tests build Prism without one of
    them to show what it fixes."""
    if not PRISM_PATCHES:
        raise BootstrapError(
            f"no Prism patches in {Path(__file__).parent / 'prism_patches'}: a stock Prism "
            "loses keyed state and data; reinstall beam-rl from its source tree"
        )
    version = version or sdk_version()
    patches = PRISM_PATCHES if patches is None else patches
    target = prism_path(version, patches)
    if target.is_file():
        return target
    go = require_tool(
        "go", "install Go >= 1.25 (Beam 2.70's go.mod needs it; https://go.dev/doc/install) to build Prism"
    )
    git = require_tool("git", "install git (its `git apply` patches Prism's source)")
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    # The Go checksum database does not list every Beam release; the module proxy still serves it,
    # so only Beam's own module skips the sumdb lookup.
    env = dict(os.environ, GOFLAGS="-mod=mod", GONOSUMDB="github.com/apache/beam")
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        module = f"github.com/apache/beam/sdks/v2@v{version}"
        download = json.loads(
            _run([go, "mod", "download", "-json", module], f"Prism: downloading {module}", env=env, cwd=Path(work))
        )
        source, tree = Path(download["Dir"]), Path(work) / "sdks"
        # The Go sources only (the module also holds Java, Python and TypeScript), made writable:
        # the module cache is read-only.
        shutil.copytree(source / "go", tree / "go", copy_function=shutil.copyfile)
        for name in ("go.mod", "go.sum"):
            shutil.copyfile(source / name, tree / name)
        for directory, _, _ in os.walk(tree):
            os.chmod(directory, 0o755)
        for patch in patches:
            _run([git, "apply", "-p1", str(patch)], f"Prism: patching ({patch.name})", cwd=tree, progress=False)
        _run(
            [go, "build", "-o", str(Path(work) / "prism"), "./go/cmd/prism"],
            f"Prism: building v{version} (a minute or two the first time)",
            env=env,
            cwd=tree,
        )
        os.replace(Path(work) / "prism", target)
    _LOG.debug("built Prism v%s (%d patches) in %.1fs -> %s", version, len(patches), time.monotonic() - started, target)
    return target


# The Flink runner's own job-service module (`beam-runners-java-job-service`, 10 classes of
# org.apache.beam.runners.jobsubmission) is served by the Maven registry only up to 2.65.0, while the runner
# is served at 2.70.0. The 2.65.0 jar is put on the 2.70.0 class path as it is: the 11 members of it the
# 2.70.0 runner calls have identical descriptors in both, and a streaming stateful pipeline and a
# GroupByKey ran on it. (Compiling its `:sources` jar gives the same classes and would need a JDK and
# auto-value besides; the jar as is needs only the Java runtime the job server needs anyway.) Its own
# dependencies are excluded, so none comes at 2.65.0: the 2.70.0 runner brings all of them at 2.70.0 but
# one, beam-sdks-java-expansion-service (the job server starts an expansion service), named here at 2.70.0.
# slf4j-simple 2.0.x, not 1.7.x: the 2.70.0 runner uses slf4j-api 2.0.16, which ignores a 1.7 binding
# ("No SLF4J providers were found"), and the job server would then log nothing, not even the
# "Rest endpoint listening at" line runners/job_server.py waits for.
JOB_SERVICE_VERSION = "2.65.0"
SLF4J_VERSION = "2.0.16"

_JOB_SERVER_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>beam-rl</groupId><artifactId>flink-job-server</artifactId><version>{beam}</version>
  <dependencies>
    <dependency>
      <groupId>org.apache.beam</groupId><artifactId>beam-runners-flink-{flink}</artifactId>
      <version>{beam}</version>
      <exclusions>
        <exclusion><groupId>org.apache.beam</groupId><artifactId>beam-runners-java-job-service</artifactId></exclusion>
      </exclusions>
    </dependency>
    <dependency>
      <groupId>org.apache.beam</groupId><artifactId>beam-runners-java-job-service</artifactId>
      <version>{job_service}</version>
      <exclusions><exclusion><groupId>*</groupId><artifactId>*</artifactId></exclusion></exclusions>
    </dependency>
    <dependency>
      <groupId>org.apache.beam</groupId><artifactId>beam-sdks-java-expansion-service</artifactId>
      <version>{beam}</version>
    </dependency>
    <dependency>
      <groupId>org.slf4j</groupId><artifactId>slf4j-simple</artifactId><version>{slf4j}</version>
    </dependency>
  </dependencies>
</project>
"""


# Fixes to the job server's Beam classes, as patches to the sources of `org.apache.beam:beam-sdks-java-core`,
# compiled against the assembled class path into a jar that comes first on it (docs/runners.md).
JOB_SERVER_PATCHES = sorted((Path(__file__).parent / "job_server_patches").glob("*.patch"))
_PATCHED_ARTIFACT = "beam-sdks-java-core"


def ensure_flink_job_server(
    version: str | None = None, flink: str = FLINK_VERSION, patches: list[Path] | None = None
) -> Path:
    """A runnable Flink job-server jar for Beam `version` (default: the installed SDK's), assembled with
    Maven on first use, with `patches` (default: all of `JOB_SERVER_PATCHES`; the jar's name carries their
    digest, as Prism's path does)."""
    if not JOB_SERVER_PATCHES:
        raise BootstrapError(
            f"no job server patches in {Path(__file__).parent / 'job_server_patches'}: a stock job "
            "server listens on every interface; reinstall beam-rl from its source tree"
        )
    version = version or sdk_version()
    patches = JOB_SERVER_PATCHES if patches is None else patches
    home = cache_root() / "flink-job-server" / f"beam-{version}-flink-{flink}"
    stock = home / f"beam-runners-flink-{flink}-job-server-{version}.jar"
    jar = stock.with_name(f"{stock.stem}-{_patches_digest(patches)}.jar") if patches else stock
    if jar.is_file():
        return jar
    if not stock.is_file():
        _assemble_job_server(home, stock, version, flink)
    if patches:
        patched = _compile_patches(home, version, patches)
        _write_launcher_jar(jar, [patched.name, *_launcher_class_path(stock)])
    return jar


def _assemble_job_server(home: Path, jar: Path, version: str, flink: str) -> None:
    """The stock job server: its dependencies under `home/lib`, and `jar`, a launcher that names them."""
    require_tool("java", "install a Java 11+ runtime (e.g. `apt-get install openjdk-17-jre-headless`)")
    mvn = require_tool("mvn", "install Maven (e.g. `apt-get install maven`) to fetch the Flink runner")
    started = time.monotonic()
    home.mkdir(parents=True, exist_ok=True)
    (home / "pom.xml").write_text(
        _JOB_SERVER_POM.format(beam=version, flink=flink, job_service=JOB_SERVICE_VERSION, slf4j=SLF4J_VERSION)
    )
    lib = home / "lib"
    _run(
        [mvn, "-q", "-B", "dependency:copy-dependencies", f"-DoutputDirectory={lib}", "-DincludeScope=runtime"],
        f"Flink job server: fetching org.apache.beam:beam-runners-flink-{flink}:{version} and its dependencies",
        cwd=home,
    )
    jars = sorted(p.name for p in lib.glob("*.jar"))
    for needed in (
        f"beam-runners-flink-{flink}-{version}.jar",
        f"beam-runners-java-job-service-{JOB_SERVICE_VERSION}.jar",
        f"beam-sdks-java-expansion-service-{version}.jar",
        f"slf4j-simple-{SLF4J_VERSION}.jar",
    ):
        if needed not in jars:
            raise BootstrapError(f"Maven resolved no {needed} into {lib}")
    stale = [name for name in jars if name.startswith("slf4j-simple-") and name != f"slf4j-simple-{SLF4J_VERSION}.jar"]
    if stale:  # a second binding on the class path: slf4j picks either
        raise BootstrapError(f"{lib} holds {stale} beside slf4j-simple {SLF4J_VERSION}; remove {home} and rerun")
    _write_launcher_jar(jar, [f"lib/{name}" for name in jars])
    _LOG.debug("assembled Flink job server in %.1fs -> %s", time.monotonic() - started, jar)


def _launcher_class_path(jar: Path) -> list[str]:
    """The Class-Path a launcher jar's manifest names."""
    with zipfile.ZipFile(jar) as zf:
        manifest = zf.read("META-INF/MANIFEST.MF").decode().replace("\r\n", "\n").replace("\n ", "")
    line = next(line for line in manifest.splitlines() if line.startswith("Class-Path: "))
    return line.removeprefix("Class-Path: ").split()


def _compile_patches(home: Path, version: str, patches: list[Path]) -> Path:
    """A jar, in `home`, of the classes of `_PATCHED_ARTIFACT`'s sources with `patches` applied, compiled
    against the job server's class path."""
    target = home / f"patches-{_patches_digest(patches)}.jar"
    if target.is_file():
        return target
    mvn = require_tool("mvn", "install Maven (e.g. `apt-get install maven`) to fetch the Flink runner")
    javac = require_tool(
        "javac",
        "install a JDK 11+ (e.g. `apt-get install openjdk-17-jdk-headless`): the job "
        "server's patched classes are compiled",
    )
    git = require_tool("git", "install git (its `git apply` patches the job server's sources)")
    with tempfile.TemporaryDirectory(dir=home) as work:
        work_dir = Path(work)
        _run(
            [
                mvn,
                "-q",
                "-B",
                "dependency:copy",
                f"-Dartifact=org.apache.beam:{_PATCHED_ARTIFACT}:{version}:jar:sources",
                f"-DoutputDirectory={work_dir}",
            ],
            f"Flink job server: fetching the sources of {_PATCHED_ARTIFACT} {version}",
            cwd=home,
        )
        sources = [
            line.split()[1].removeprefix("b/")
            for patch in patches
            for line in patch.read_text().splitlines()
            if line.startswith("+++ ")
        ]
        src = work_dir / "src"
        with zipfile.ZipFile(work_dir / f"{_PATCHED_ARTIFACT}-{version}-sources.jar") as zf:
            for name in sources:
                zf.extract(name, src)
        for patch in patches:
            _run(
                [git, "apply", "-p1", str(patch)], f"Flink job server: patching ({patch.name})", cwd=src, progress=False
            )
        classes = work_dir / "classes"
        _run(
            [
                javac,
                "-nowarn",
                "-proc:none",
                "--release",
                "11",
                "-cp",
                str(home / "lib" / "*"),
                "-d",
                str(classes),
                *sources,
            ],
            "Flink job server: compiling the patched classes",
            cwd=src,
        )
        tmp = target.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w") as zf:
            for path in sorted(classes.rglob("*.class")):
                zf.write(path, path.relative_to(classes).as_posix())
        os.replace(tmp, target)
    return target


def _write_launcher_jar(jar: Path, class_path: list[str]) -> None:
    """A jar holding only a manifest: `java -jar` runs the driver with the listed jars."""
    manifest = f"Manifest-Version: 1.0\nMain-Class: {_FLINK_MAIN_CLASS}\n"
    manifest += _manifest_line("Class-Path: " + " ".join(class_path)) + "\n"
    tmp = jar.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w") as zf:
        zf.writestr("META-INF/MANIFEST.MF", manifest.replace("\n", "\r\n"))
    os.replace(tmp, jar)


def _manifest_line(line: str) -> str:
    """Manifest lines are at most 72 bytes; continuation lines start with one space."""
    chunks = [line[:72]] + [" " + line[i : i + 71] for i in range(72, len(line), 71)]
    return "\n".join(chunks)


FLINK_CLUSTER_VERSION = "1.19.0"  # the Flink the job server speaks (FLINK_VERSION) at this Beam version


def ensure_flink_distribution(version: str = FLINK_CLUSTER_VERSION) -> Path:
    """A standalone Flink distribution (FLINK_HOME: bin/, lib/, conf/) of `version`, for a cluster on this
    machine. It comes inside the PyPI apache-flink wheel, installed without its Python dependencies (it pins
    an older Beam) into a virtualenv of its own, cached; only its Java distribution is used."""
    root = cache_root() / f"flink-cluster-{version}"
    stamp = root / "venv" / ".installed"
    if stamp.is_file():
        return Path(stamp.read_text().strip())
    started = time.monotonic()
    venv = root / "venv"
    root.mkdir(parents=True, exist_ok=True)
    if not (venv / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(venv)], "creating the Flink distribution's virtualenv")
    _run(
        [
            str(venv / "bin" / "pip"),
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            f"apache-flink=={version}",
            f"apache-flink-libraries=={version}",
        ],
        f"installing apache-flink {version}",
    )
    home = Path(
        _run(
            [str(venv / "bin" / "python"), "-c", "import os, pyflink; print(os.path.dirname(pyflink.__file__))"],
            "locating the Flink distribution",
        ).strip()
    )
    for script in (home / "bin").iterdir():
        script.chmod(script.stat().st_mode | 0o755)
    if not list((home / "lib").glob("flink-dist*.jar")):
        raise BootstrapError(f"apache-flink {version} has no lib/flink-dist*.jar under {home}")
    stamp.write_text(f"{home}\n")
    _LOG.info("Flink %s distribution ready in %.1fs -> %s", version, time.monotonic() - started, home)
    return home


_PARTS: dict[str, tuple[str, Callable[[str], Path]]] = {
    "prism": ("Prism", ensure_prism),
    "flink-job-server": ("Flink job server", ensure_flink_job_server),
    "flink-cluster": ("Flink distribution", lambda _version: ensure_flink_distribution()),
}


def main(argv: list[str] | None = None) -> None:
    """`python -m runners.bootstrap PART... [--beam-version V]`: make runner binaries ready, saying what
    each step took."""
    parser = argparse.ArgumentParser(prog="python -m runners.bootstrap", description=main.__doc__)
    parser.add_argument("parts", nargs="+", choices=sorted(_PARTS))
    parser.add_argument("--beam-version", help="default: the installed Beam SDK's")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[setup] %(message)s")
    version = args.beam_version or sdk_version()
    for part in args.parts:
        what, ensure = _PARTS[part]
        started = time.monotonic()
        path = ensure(version)
        _LOG.info("%s for Beam %s ready (%.0f s): %s", what, version, time.monotonic() - started, path)


if __name__ == "__main__":
    main()

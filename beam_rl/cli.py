"""The `beam-rl` command: the whole RL loop, the rollout pipeline or the trainer alone, and views of a
run directory."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from beam_rl.config import ConfigError, RunConfig, load_config
from beam_rl.envs.datasets import DatasetError
from beam_rl.observe.report import COMMITTED_COLUMNS, StepRow, StepTable
from beam_rl.processes import ChildFailedError, keep_triton_out
from beam_rl.rundir import CommitRecord, CommitRecordError, RunDir, RunDirError, StepCorruptError
from beam_rl.rundir.failures import ServersNotReadyError, read_failure
from beam_rl.rundir.lease import RunDirBusyError
from schemas.train_batch import SchemaError

if TYPE_CHECKING:
    from beam_rl.fleet.assignment import Fleet

console = Console()
_LOG = logging.getLogger(__name__)


def inspect_table(run_dir: RunDir) -> Table:
    """The committed steps, one row each, from their commit records (CommitRecordError on a damaged one)."""
    table = _step_table(run_dir)
    for step in run_dir.committed_steps():
        _add_step_row(table, run_dir.read_commit(step))
    return table


def _step_table(run_dir: RunDir) -> StepTable:
    return StepTable(COMMITTED_COLUMNS, title=f"run {run_dir.path}")


def _add_step_row(table: StepTable, record: CommitRecord) -> None:
    table.add_step(StepRow.from_commit(record))


def _cmd_inspect(args: argparse.Namespace) -> int:
    """The step table, with every committed file verified against its commit record: a damaged step is
    left out of the table and named in one red line (exit status 2); a file in a step directory that its
    commit record does not list is named in a yellow line (readers never open it: not an error)."""
    if args.step is not None or args.rollout:
        return _cmd_inspect_samples(args)
    run_dir = RunDir(args.run_dir)
    if not run_dir.path.is_dir():
        console.print(f"[red]no run directory at {run_dir.path}[/red]")
        return 2
    table, damaged, stray, verified = _step_table(run_dir), [], [], []
    for step in run_dir.committed_steps():
        try:
            record = run_dir.read_commit(step)
            stray += run_dir.verify_step(record)
        except (CommitRecordError, StepCorruptError) as err:
            damaged.append(err)
            continue
        _add_step_row(table, record)
        verified.append(step)
    console.print(table)
    for line in _decision_lines(run_dir, verified):
        console.print(line)
    for line in _live_lines(run_dir):
        console.print(line)
    for path in stray:
        console.print(
            f"[yellow]{escape(str(path))}: not listed in its step's commit record; readers ignore it[/yellow]"
        )
    for problem in damaged:
        console.print(f"[red]{escape(str(problem))}[/red]")
    return 2 if damaged else 0


def _live_lines(run_dir: RunDir) -> list[str]:
    """What the run's dispatch shards last said that no commit record holds: why the run stopped (failure.json),
    and the newest causes of errored rollouts with counts and an example each (status-*.json)."""
    from beam_rl.observe.report import error_lines

    lines = []
    if (failure := read_failure(run_dir.path)) is not None:
        lines.append(f"[red]stopped: {escape(str(failure))}[/red]")
    errors = error_lines(run_dir.read_status(), limit=10)
    if errors:
        lines.append("errored rollouts by cause, the newest first (status-*.json):")
        lines += [f"  [red]{escape(line)}[/red]" for line in errors]
    return lines


def _cmd_status(args: argparse.Namespace) -> int:
    """A run's state as its dispatch shards last wrote it, for a run going on or one that stopped: its
    committed steps, what is in flight, how many rollouts ended how, and its errors by cause."""
    run_dir = RunDir(args.run_dir)
    if not run_dir.path.is_dir():
        console.print(f"[red]no run directory at {run_dir.path}[/red]")
        return 2
    last = run_dir.last_committed_step()
    status = run_dir.read_status()
    steps = f"steps 1..{last} committed" if last else "no step committed"
    console.print(f"run {escape(str(run_dir.path))}: {steps}")
    if status:
        shards = status.get("shards", 1)
        console.print(
            f"dispatch ({shards} shard{'s' if shards > 1 else ''}), "
            f"{time.time() - status.get('updated_at', 0):.0f}s ago: policy v{status.get('policy_version', 0)}, {status.get('inflight', 0)} in flight; "
            f"rollouts ok {status.get('ok', 0)}, errored {status.get('errored', 0)}, "
            f"cancelled {status.get('cancelled', 0)}"
        )
    for line in _live_lines(run_dir):
        console.print(line)
    return 0


def _decision_lines(run_dir: RunDir, steps: list[int]) -> list[str]:
    """What the source decided in the run's committed `steps`: its curriculum and its mix of environments,
    when its config has them (and can be read)."""
    from beam_rl.config import config_from_dict
    from beam_rl.source import curriculum, mixing

    try:
        config = config_from_dict(run_dir.read_config(), source=str(run_dir.config_path))
    except (RunDirError, ValueError):
        return []
    return [
        escape(line) for describe in (curriculum.describe, mixing.describe) for line in describe(run_dir, config, steps)
    ]


def _cmd_inspect_samples(args: argparse.Namespace) -> int:
    """Rollouts of one step's window as text (`--step N --samples K`, or `--rollout ID`); a bad step, an
    unknown rollout or a damaged window is one red line and exit status 2."""
    from beam_rl.model.location import tokenizer_for
    from beam_rl.observe.rollout_text import RolloutNotFound, TokenText, find_step, rollout_panel, window_rows
    from beam_rl.packing.goodput import describe

    run_dir = RunDir(args.run_dir)
    if not run_dir.path.is_dir():
        console.print(f"[red]no run directory at {run_dir.path}[/red]")
        return 2
    step = args.step if args.step is not None else find_step(run_dir, args.rollout[0])
    committed = run_dir.committed_steps()
    if step is None or step not in committed:
        have = f"committed steps: {committed[0]}..{committed[-1]}" if committed else "no step is committed"
        what = f"step {step} is not committed" if step is not None else f"no committed step holds {args.rollout[0]}"
        console.print(f"[red]{escape(str(run_dir.path))}: {escape(what)} ({have})[/red]")
        return 2
    try:
        fates = run_dir.read_commit(step).window.tokens_by_fate
        window = run_dir.read_window(step)
        rows = window_rows(window, args.samples, args.rollout or ())
    except (CommitRecordError, StepCorruptError) as err:
        console.print(f"[red]{escape(str(err))}[/red]")
        return 2
    except RolloutNotFound as err:
        console.print(f"[red]step {step}'s window holds no rollout or group {escape(str(err.args[0]))}[/red]")
        return 2
    model = args.tokenizer or _run_model_name(run_dir)
    if model is None:
        console.print(
            f"[red]{escape(str(run_dir.path))} holds no config.json to name its tokenizer: "
            "give --tokenizer (tiny, or a local model directory)[/red]"
        )
        return 2
    text = TokenText(tokenizer_for(model))
    console.print(
        f"step {step}: {len(rows)} of the {window.num_rows} rollouts in its window "
        f"({escape(str(run_dir.window_path(step)))})"
    )
    console.print(describe(fates))
    for row in rows:
        console.print(rollout_panel(row, text))
    return 0


def _run_model_name(run_dir: RunDir) -> str | None:
    from beam_rl.config import config_from_dict

    if not run_dir.config_path.is_file():
        return None
    return config_from_dict(run_dir.read_config(), source=str(run_dir.config_path)).model.name


def _cmd_replay(args: argparse.Namespace) -> int:
    """Replay committed steps from their windows and compare with the committed files; exit status 1 naming
    each differing step's first difference, 2 when a step cannot be replayed."""
    from beam_rl import wiring
    from beam_rl.observe.replay import ReplayError, replay_steps

    run_dir = RunDir(args.run_dir)
    committed = run_dir.committed_steps() if run_dir.path.is_dir() else []
    if not committed:
        console.print(f"[red]{escape(str(run_dir.path))} holds no committed step[/red]")
        return 2
    steps = committed if args.all else [args.step]
    config = load_config(args.config) if args.config else None
    staleness = {"on": True, "off": False, "auto": None}[args.staleness]
    identical = 0
    try:
        for result in replay_steps(run_dir, steps, wiring.replay_parts(run_dir, config, staleness)):
            if result.identical:
                identical += 1
                files = ", ".join(result.identical_files) or "no rank file"
                console.print(
                    f"[green]step {result.step}: identical[/green] ({files} byte for byte; "
                    "window.arrow advantage and filtered; COMMIT.json group ids and window stats)"
                )
            else:
                first, *rest = result.differences
                console.print(f"[red]step {result.step}: {escape(str(first))}[/red]")
                for difference in rest:
                    console.print(f"  also {escape(str(difference))}")
            for note in result.notes:
                console.print(f"  [yellow]{escape(note)}[/yellow]")
    except (ReplayError, CommitRecordError, StepCorruptError) as err:
        console.print(f"[red]{escape(str(err))}[/red]")
        return 2
    if len(steps) > 1:
        console.print(f"{identical} of {len(steps)} steps identical")
    return 0 if identical == len(steps) else 1


def preflight(config: RunConfig, source: str) -> RunDir:
    """What can be checked before a server starts or the run directory is touched (beam_rl/job/preflight.py):
    the model directory and its tokenizer, every env's dataset (the first bad row fails, named by file, line
    and field, unless run.bad_rows = "skip"), then whether the run directory is writable and its newest
    published weights fit the model. Skipped rows are reported and recorded in metrics.jsonl as
    {"dataset": {...}}."""
    from beam_rl.job.preflight import (
        check_run_records,
        load_datasets,
        model_problems,
        published_weights_problems,
        refuse,
    )

    refuse(model_problems(config), source)
    loaded, problems = load_datasets(config)
    refuse(problems, source)
    run_dir = RunDir(config.run.dir)
    run_dir.check_writable()
    check_run_records(run_dir)
    refuse(published_weights_problems(run_dir, config), source)
    for name, split, rows, skipped in loaded:
        if not skipped:
            continue
        console.print(
            f"[yellow]{name} ({split}): skipped {len(skipped)} bad rows, kept {rows} "
            f"(run.bad_rows = \"skip\"); first: {escape(str(skipped[0]))}[/yellow]"
        )
        run_dir.append_metrics(
            {
                "dataset": {
                    "env": name,
                    "split": split,
                    "rows": rows,
                    "skipped_rows": len(skipped),
                    "errors": [str(err) for err in skipped[:100]],  # enough to fix the file, bounded
                }
            }
        )
    return run_dir


def _pipeline_stopped(err: BaseException, run_dir: RunDir, since: float, again: str) -> int:
    """A run stopped by one of our own errors (disk full, every server down), which the failing stage
    recorded in the run directory since `since` (beam_rl/rundir/failures.py), or by a child process that failed
    (the trainer): its message, not Beam's whole traceback, and what the run directory still holds. Any
    other error (a busy run directory) is raised as it is, for `main`."""
    failure = err if isinstance(err, ChildFailedError) else read_failure(run_dir.path, since)
    if failure is None:
        raise err
    _LOG.info("the pipeline failed", exc_info=err)  # the full traceback with -v
    last = run_dir.last_committed_step()
    kept = f"steps 1..{last} are committed in {run_dir.path}" if last else f"no step is committed in {run_dir.path}"
    console.print(f"[red]the run stopped: {escape(str(failure))}[/red]")
    console.print(f"{kept}; {again} continues from there")
    return 1


def _cmd_rollouts(args: argparse.Namespace) -> int:
    from beam_rl.job.rollouts import run_rollouts
    from beam_rl.job.servers import inference_servers
    from beam_rl.wiring import job_parts
    from runners.beam_log import route_beam_output

    path = _given_config(args)
    if path is None:
        console.print("[red]give a CONFIG: beam-rl rollouts CONFIG[/red]")
        return 2
    config = _with_run_dir(load_config(path), args.run_dir)
    run_dir = preflight(config, path)
    route_beam_output(run_dir.path)
    started, since = time.monotonic(), time.time()
    wired = job_parts(config)
    with console.status("starting inference servers"), inference_servers(wired) as urls:
        console.print(f"inference servers: {', '.join(urls)}")
        console.print(f"running the rollout pipeline on [bold]{config.runner.name}[/bold] -> {run_dir.path}")
        try:
            run_rollouts(config, urls, with_trainer=False, parts=wired)
        except RuntimeError as err:
            return _pipeline_stopped(err, run_dir, since, "the same command")
    console.print(inspect_table(run_dir))
    console.print(f"done in {time.monotonic() - started:.1f}s; Arrow files under {run_dir.rollouts_dir}")
    return 0


def _with_run_dir(config: RunConfig, run_dir: str | None) -> RunConfig:
    if not run_dir:
        return config
    return config.model_copy(update={"run": config.run.model_copy(update={"dir": Path(run_dir)})})


def _cmd_run(args: argparse.Namespace) -> int:
    from beam_rl.config import config_from_dict

    if args.resume:
        run_dir = RunDir(args.resume)
        if not run_dir.config_path.is_file():
            console.print(f"[red]{run_dir.path} holds no config.json: not a beam-rl run directory[/red]")
            return 2
        source = str(run_dir.config_path)
        # The directory given is the run, wherever config.json says it was made (a copied or moved run).
        config = _with_run_dir(config_from_dict(run_dir.read_config(), source=source), args.resume)
    elif given := _given_config(args):
        source = given
        config = _with_run_dir(load_config(source), args.run_dir)
    else:
        console.print("[red]give a CONFIG, or --resume RUN_DIR[/red]")
        return 2
    last = RunDir(config.run.dir).last_committed_step()
    if _run_complete(config, last):
        console.print(
            f"{config.run.dir} is complete: steps 1..{last} are committed"
            + (" and trained" if config.trainer.kind == "reference" else "")
            + f"; `beam-rl report {config.run.dir}` shows them"
        )
        return 0
    run_dir = preflight(config, source)
    if last is not None:
        console.print(f"resuming {config.run.dir}: steps 1..{last} are committed, continuing at {last + 1}")
    from beam_rl.job.run import run_job  # the CLI is the one domain module that reaches the runners
    from runners.beam_log import route_beam_output

    route_beam_output(run_dir.path)
    since = time.time()
    try:
        run_job(config, console)
    except RuntimeError as err:
        return _pipeline_stopped(err, run_dir, since, f"beam-rl run --resume {run_dir.path}")
    return 0


def _run_complete(config: RunConfig, last: int | None) -> bool:
    """Every step committed (`last`), and with the reference trainer the last one trained: nothing to resume."""
    if last is None or last < config.run.max_steps:
        return False
    stable = RunDir(config.run.dir).latest_stable_weights()
    return config.trainer.kind != "reference" or (stable is not None and stable[0] >= config.run.max_steps)


def _cmd_train(args: argparse.Namespace) -> int:
    from beam_rl.config import config_from_dict
    from beam_rl.model import location
    from beam_rl.trainer.reference import run_trainer

    run_dir = RunDir(args.run_dir)
    config = (
        load_config(args.config)
        if args.config
        else config_from_dict(run_dir.read_config(), source=str(run_dir.config_path))
    )
    from beam_rl.job.preflight import model_problems, published_weights_problems, refuse

    source = args.config or str(run_dir.config_path)
    refuse(model_problems(config) + published_weights_problems(run_dir, config), source)
    import torch

    nproc = args.nproc if args.nproc is not None else config.trainer.nproc
    if nproc > 1:
        from beam_rl.trainer.data_parallel import launch

        launch(
            run_dir.path, location.model_dir(config), config.trainer, config.run.max_steps, nproc, seed=config.run.seed
        )
        return 0
    torch.set_num_threads(config.trainer.threads)
    run_trainer(run_dir, location.model_dir(config), config.trainer, config.run.max_steps, seed=config.run.seed)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from beam_rl.observe.report import weight_update_summary, write_plot

    run_dir = RunDir(args.run_dir)
    if not run_dir.committed_steps():
        console.print(f"[red]{run_dir.path} holds no committed step[/red]")
        return 2
    steps = _timeline_steps(run_dir, args.steps)
    if steps is None:
        return 2
    try:
        console.print(inspect_table(run_dir))
        console.print(f"plot: {write_plot(run_dir)}")
        updates = weight_update_summary(run_dir.read_metrics())
        if updates:
            console.print(updates)
        return _report_timeline(run_dir, steps)
    except CommitRecordError as err:
        console.print(f"[red]{escape(str(err))}[/red]")
        return 2


def _timeline_steps(run_dir: RunDir, steps_text: str | None) -> list[int] | None:
    """The committed steps `report --steps` names; None after a red line saying why there are none."""
    from beam_rl.observe.timeline import StepRangeError, parse_steps

    try:
        return parse_steps(steps_text, run_dir.committed_steps())
    except StepRangeError as err:
        console.print(f"[red]{escape(str(err))}[/red]")
        return None


def _report_timeline(run_dir: RunDir, steps: list[int]) -> int:
    """The latency table of the chosen steps and timeline.png (latency and each server's requests)."""
    from beam_rl.observe.timeline import latency_breakdown, latency_table, read_timelines, write_timeline

    try:
        timelines = read_timelines(run_dir, steps)
    except StepCorruptError as err:
        console.print(f"[red]{escape(str(err))}[/red]")
        return 2
    console.print(latency_table(latency_breakdown(timelines), steps))
    console.print(f"timeline: {write_timeline(run_dir, steps, timelines)}")
    return 0


def _cmd_servers(args: argparse.Namespace) -> int:
    """Edit or show a run's fleet: its servers file (read by inference.discovery = "file"), each server's
    shard from fleet.json, and what the shards' status says of it."""
    from beam_rl.fleet.assignment import Fleet
    from beam_rl.fleet.discovery import DiscoveryError, ServersFile

    run_dir = RunDir(args.run_dir)
    if not run_dir.path.is_dir():
        console.print(f"[red]no run directory at {run_dir.path}[/red]")
        return 2
    if args.action != "list" and not args.url:
        console.print(f"[red]beam-rl servers {args.action} needs the server's base URL[/red]")
        return 2
    servers = ServersFile.of_run(run_dir.path)
    try:
        if args.action == "add":
            done = servers.add(args.url)
            console.print(f"{escape(args.url)} {'added to' if done else 'is already in'} {servers.path}")
        elif args.action == "remove":
            done = servers.remove(args.url)
            console.print(f"{escape(args.url)} {'removed from' if done else 'is not in'} {servers.path}")
        listed = servers.read() if servers.exists() else []
        fleet = Fleet.read(run_dir.fleet_path)
    except (DiscoveryError, ValueError) as err:
        console.print(f"[red]{escape(str(err))}[/red]")
        return 2
    discovery = run_dir.read_config().get("inference", {}).get("discovery") if run_dir.config_path.is_file() else None
    if discovery not in (None, "file"):
        console.print(
            f"[yellow]this run's inference.discovery is {discovery!r}: it does not read {servers.path}[/yellow]"
        )
    if args.action == "list":
        console.print(_fleet_table(run_dir, listed, fleet))
    return 0


def _fleet_table(run_dir: RunDir, listed: list, fleet: Fleet | None) -> Table:
    live = {s["url"]: s for s in run_dir.read_status().get("servers", []) if isinstance(s, dict) and "url" in s}
    placed = {p.url: p for p in fleet.servers} if fleet is not None else {}
    table = Table(title=f"fleet of {run_dir.path}")
    for column in ("server", "listed", "shard", "joined", "state", "rollouts in flight"):
        table.add_column(column)
    for url in sorted({line.url for line in listed} | set(placed) | set(live)):
        line = next((x for x in listed if x.url == url), None)
        placement, state = placed.get(url), live.get(url, {})
        joined = state.get("joined_at") or (placement.joined_at if placement else None)
        status = (
            "joining"
            if state.get("joining")
            else "draining"
            if state.get("draining")
            else "healthy"
            if state.get("healthy")
            else "down"
            if state
            else "-"
        )
        table.add_row(
            url,
            "embedded" if line and line.embedded else "yes" if line else "no",
            str(placement.shard) if placement else "-",
            time.strftime("%H:%M:%S", time.localtime(joined)) if joined else "-",
            status,
            str(state.get("inflight", "-")),
        )
    return table


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    """`run` and `rollouts` take the same arguments: CONFIG, or `--config CONFIG` (the older spelling of
    `rollouts`, kept as an alias), and `--run-dir`."""
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="a TOML run config (see configs/)")
    parser.add_argument("--config", dest="config_option", metavar="CONFIG", help="the same as CONFIG (an alias)")
    parser.add_argument("--run-dir", help="the run directory, instead of the config's run.dir")


def _given_config(args: argparse.Namespace) -> str | None:
    """CONFIG, given either way; both given must agree (ConfigError otherwise)."""
    if args.config and args.config_option and args.config != args.config_option:
        raise ConfigError(args.config, [("", f"a second config is given with --config: {args.config_option}")])
    return args.config or args.config_option


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="beam-rl", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    rollouts = sub.add_parser("rollouts", help="run the rollout pipeline (no trainer) into a run directory")
    _config_arguments(rollouts)
    rollouts.set_defaults(func=_cmd_rollouts)

    run = sub.add_parser("run", help="the whole RL loop: servers, rollout pipeline, reference trainer")
    _config_arguments(run)
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a killed run from its run directory (its config.json), instead of CONFIG",
    )
    run.set_defaults(func=_cmd_run)

    train = sub.add_parser("train", help="the reference trainer, reading and publishing in a run directory")
    train.add_argument("--run-dir", required=True, help="the run directory to read steps from and publish weights into")
    train.add_argument("--config", help="default: the run directory's config.json")
    train.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="data-parallel ranks, each reading its own rank file (batch.trainer_ranks); 1: the "
        "reference trainer, standing in for every rank (default: trainer.nproc)",
    )
    train.set_defaults(func=_cmd_train)

    report = sub.add_parser("report", help="the step table and a PNG plot of reward, lag and throughput")
    report.add_argument("run_dir", help="a run directory")
    report.add_argument(
        "--steps",
        metavar="A:B",
        help="the steps of the latency table and timeline.png, both included (A:, :B, N); default: all",
    )
    report.set_defaults(func=_cmd_report)

    inspect = sub.add_parser(
        "inspect", help="print a table of a run directory's committed steps, or rollouts of one step as text"
    )
    inspect.add_argument("run_dir", help="a run directory (committed or not)")
    inspect.add_argument("--step", type=int, metavar="N", help="show rollouts of step N's window as text")
    inspect.add_argument("--samples", type=int, default=4, metavar="K", help="how many (the first K; default 4)")
    inspect.add_argument(
        "--rollout",
        action="append",
        metavar="ID",
        help="show this rollout (or every rollout "
        "of this group) instead; repeatable; without --step, the step is found",
    )
    inspect.add_argument("--tokenizer", help="tiny, or a local model directory (default: the run's model)")
    inspect.set_defaults(func=_cmd_inspect)

    replay = sub.add_parser(
        "replay",
        help="redo scoring, filtering, advantages and packing of committed steps "
        "from their windows and compare with the committed files, bit for bit",
    )
    replay.add_argument("run_dir", help="a run directory with committed steps")
    which = replay.add_mutually_exclusive_group(required=True)
    which.add_argument("--step", type=int, metavar="N", help="replay committed step N")
    which.add_argument("--all", action="store_true", help="every committed step")
    replay.add_argument(
        "--config",
        help="the run's TOML config (default: the run directory's config.json; a `beam-rl rollouts` run writes none)",
    )
    replay.add_argument(
        "--staleness",
        choices=("auto", "on", "off"),
        default="auto",
        help="whether the run's packer checked staleness; auto: on for a `beam-rl run` run "
        "(it has a config.json), off for a `beam-rl rollouts` one",
    )
    replay.set_defaults(func=_cmd_replay)

    status = sub.add_parser(
        "status",
        help="a run's state as it goes on (or as it stopped): committed steps, "
        "rollouts in flight and their outcomes, errors by cause with an example each",
    )
    status.add_argument("run_dir", help="a run directory")
    status.set_defaults(func=_cmd_status)

    servers = sub.add_parser(
        "servers",
        help="add a server to a running run's fleet, remove one (it drains), or "
        "list them (inference.discovery = \"file\")",
    )
    servers.add_argument("action", choices=("add", "remove", "list"), help="add or remove a server, or list the fleet")
    servers.add_argument("run_dir", help="the run directory whose fleet it is")
    servers.add_argument("url", nargs="?", help="the server's base URL (add, remove)")
    servers.set_defaults(func=_cmd_servers)
    return parser


def main(argv: list[str] | None = None) -> int:
    keep_triton_out()
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the rest
    # Beam warns at import that the Google Cloud Storage filesystem is not installed: runs here use local paths.
    logging.getLogger("apache_beam.io.filesystems").setLevel(logging.ERROR)
    try:
        return args.func(args)
    except (ConfigError, RunDirError, RunDirBusyError, DatasetError, ServersNotReadyError) as err:
        console.print(f"[red]{escape(str(err))}[/red]")
        return 2
    except ChildFailedError as err:  # the trainer: its log says why
        console.print(f"[red]{escape(str(err))}[/red]")
        return 1
    except SchemaError as err:  # a commit record or an Arrow file this beam-rl cannot read
        console.print(f"[red]{escape(str(err))}[/red]")
        return 2
    except KeyboardInterrupt as err:
        # The job cancelled the pipeline and stopped its servers and trainer on the way out;
        # committed steps are whole, and `beam-rl run --resume RUN_DIR` continues after them.
        signum = getattr(err, "signal", signal.SIGINT)
        console.print(
            f"[yellow]interrupted ({signum.name}): committed steps are kept; "
            "`beam-rl run --resume RUN_DIR` continues[/yellow]"
        )
        return 128 + signum
    except Exception as err:  # anything no clause above knows: still one line, the traceback with -v
        if args.verbose:
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        console.print(
            f"[red]beam-rl {args.command} failed: {type(err).__name__}"
            f"{': ' + escape(first) if first else ''} (`beam-rl -v {args.command} ...` shows where)[/red]"
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())

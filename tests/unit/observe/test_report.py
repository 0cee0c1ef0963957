"""The step rows' goodput: the `good` column of every step table and report.png's tokens-by-fate panel."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from beam_rl.observe.report import STEP_COLUMNS, plot_tokens_by_fate, step_rows  # noqa: E402
from beam_rl.rundir import RunDir  # noqa: E402
from beam_rl.types import TrainBatch  # noqa: E402

FATES = {1: {"trained": 90, "stale": 6, "filtered/zero_advantage": 4},
         2: {"trained": 50, "server_failure": 50},
         3: {}}  # a step that decided no token's fate


def _run(tmp_path) -> RunDir:
    run = RunDir(tmp_path)
    for step, fates in FATES.items():
        run.write_step(TrainBatch(step=step, micro_batches=[], group_ids=[], window={"tokens_by_fate": fates}))
    return run


def test_goodput_is_each_steps_trained_share_of_the_tokens_it_decided(tmp_path):
    rows = step_rows(_run(tmp_path))
    assert [r.goodput for r in rows] == [0.9, 0.5, None]
    assert [STEP_COLUMNS["good"].cell(r) for r in rows] == ["90%", "50%", "-"]


def test_the_panel_stacks_tokens_by_fate_trained_first_and_plots_goodput(tmp_path):
    rows = step_rows(_run(tmp_path))
    fig, ax = plt.subplots()
    try:
        plot_tokens_by_fate(ax, rows)
        stacks = {bars.get_label(): [bar.get_height() for bar in bars] for bars in ax.containers}
        assert list(stacks) == ["trained", "filtered/zero_advantage", "server_failure", "stale"]
        assert stacks == {"trained": [90, 50, 0], "filtered/zero_advantage": [4, 0, 0],
                          "server_failure": [0, 50, 0], "stale": [6, 0, 0]}
        tops = [bar.get_y() + bar.get_height() for bar in ax.containers[-1]]
        assert tops == [100, 100, 0]  # stacked: each step's bar reaches its generated tokens
        (share_axis,) = [other for other in fig.axes if other is not ax]
        (line,) = share_axis.get_lines()
        assert list(line.get_xdata()) == [1, 2, 3] and list(line.get_ydata())[:2] == [0.9, 0.5]
    finally:
        plt.close(fig)

"""`gpuctl cost --plot FILE`: cumulative dollars against epoch and against time, one line per run.

matplotlib is an optional extra (`pip install 'gpuctl[plot]'`), imported only here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuctl.errors import ConfigError
from gpuctl.model.results import CostReport, PlanReport


def check_target(path: Path) -> Path:
    """Refuse before any work: a missing directory or a missing matplotlib."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ConfigError(f"cannot write {path}: the plot is a PNG image", "Name the file with .png, e.g. --plot cost.png.")
    if path.is_dir():
        raise ConfigError(f"cannot write {path}: it is a directory", "Name a file, e.g. --plot cost.png.")
    if not path.parent.is_dir():
        raise ConfigError(f"cannot write {path}: the directory {path.parent} does not exist",
                          "Create it first, or pass a path in an existing directory.")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed",
                          "pip install 'gpuctl[plot]' (or pip install matplotlib).") from None
    return path


def plot(report: CostReport, path: Path) -> int:
    """Write the PNG; the number of runs drawn."""
    import matplotlib.pyplot as plt

    fig, drawn = figure(report)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def figure(report: CostReport) -> "tuple[Any, int]":
    """The matplotlib figure and the number of runs drawn (the caller saves and closes it)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    runs = [r for r in report.runs if r.epochs]
    fig, (by_epoch, by_time) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in runs:
        label = f"{r.run_id} ({r.instance_type or '?'}, {r.market or '?'})"
        epochs = [e.epoch for e in r.epochs]
        cumulative = [e.cumulative_usd for e in r.epochs]
        by_epoch.plot(epochs, cumulative, marker="o", label=label)
        minutes, t = [], 0.0
        for e in r.epochs:
            t += e.seconds
            minutes.append(t / 60.0)
        by_time.plot(minutes, cumulative, marker="o", label=label)
    from matplotlib.ticker import MaxNLocator

    by_epoch.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_epoch.set(title="Cumulative cost by epoch", xlabel="epoch", ylabel="US dollars")
    by_time.set(title="Cumulative cost over training time", xlabel="minutes of training", ylabel="US dollars")
    for ax in (by_epoch, by_time):
        ax.grid(alpha=0.3)
        # Dollars start at zero: autoscaling from the first epoch's cost makes small spend look steep.
        ax.set_ylim(bottom=0)
    if runs:
        by_epoch.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig, len(runs)


def plan_plot(report: PlanReport, path: Path) -> int:
    """`gpuctl plan --plot`: projected dollars against hours, one point per machine measured; the
    number of points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(r.label, r.fastest, s / 3600.0, usd) for r in report.rows
              if (usd := r.projected_usd) is not None and (s := r.projected_s) is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, fastest, hours, usd in points:
        ax.scatter([hours], [usd], s=40)
        ax.annotate(f"{label}{' (fastest)' if fastest else ''}", (hours, usd),
                    textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set(title=f"{report.epochs} epochs of {Path(report.project).name}, projected from the probes",
           xlabel="hours", ylabel="US dollars")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)  # dollars start at zero, as in `cost --plot`
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return len(points)

"""`gpuctl status` and `gpuctl cost`: the tables, the compare view, the CSV.

Under the width rule of cli/render/__init__.py (money and ids whole), each table drops columns in this order:
- status clusters: provider, uptime, state (kept: cluster, $/h, $ so far)
- status runs: image, TF, last metrics (after wrapping), elapsed, cluster, epoch (kept: run, state, $ on instance)
- cost clusters: provider, state, $ spot saved, uptime, $ storage, $ idle, $ compute, $/h (kept: cluster, $)
- cost runs: finish, ex/s, mean epoch, $/M ex, cluster, state, epochs (kept: run, $ epochs, $ projected)
- epoch tables: examples, seconds, ex/s, metrics (which wraps first) (kept: epoch, $ epoch, $ cumulative)
- compare: runs side by side while they fit; else one row per run, dropping image, ex/s, TF, epochs,
  $/M ex, epoch time, market, type, $/h (kept: run, $/epoch, projected)
and stacks one block per row when even the kept columns do not fit. Wrapping comes before any drop.
"""

from __future__ import annotations

import csv
import sys
import time
from typing import TYPE_CHECKING, Callable, Sequence, TextIO

from rich.console import Console

from gpuctl.cli.render import (
    Col,
    clock,
    console,
    duration,
    fit,
    hidden_note,
    metrics,
    notes,
    num,
    say,
    table,
    text_block,
    usd,
)
from gpuctl.cli.render import snapshots as render_snapshots
from gpuctl.cli.render import volumes as render_volumes
from gpuctl.model.data import size_text
from gpuctl.model.untrusted import clean
from gpuctl.payloads.gpuctl_queue import ordinal  # one wording of a queued run's place, here and in its log

if TYPE_CHECKING:
    from gpuctl.model.records import CodeVersion
    from gpuctl.model.results import (
        ClusterCost,
        CostReport,
        NotebookSession,
        RunCost,
        SegmentCost,
        StatusAll,
        StatusReport,
    )
    from gpuctl.ops.checkpoints import CheckpointStorage
    from gpuctl.ops.images import ImageStorage

RECENT_RUNS = 3  # `cost` prints epoch tables for this many newest runs unless --all or runs are named


def _labels(clusters: Sequence[ClusterCost]) -> dict[int, str]:
    """Each cluster's name, with `#id` where a name was used by several clusters (every `up` is its
    own cluster; the rows must stay apart even when other columns are dropped)."""
    names = [c.name for c in clusters]
    return {c.id: c.name if names.count(c.name) == 1 else f"{c.name}#{c.id}" for c in clusters}


def status(report: StatusReport | StatusAll, out: Console | None = None, now: float | None = None) -> None:
    out = out or console()
    try:
        _status(report, out, now)
    finally:
        if not hasattr(report, "resources"):  # `status --all` says its notes under its inventory
            notes(report.notes)


def _status(report: StatusReport | StatusAll, out: Console, now: float | None) -> None:
    now = time.time() if now is None else now
    hidden = getattr(report, "hidden_clusters", 0)
    if hidden:
        say(out, f"{hidden} cluster(s) released over a week ago not shown: `gpuctl status --all` shows them.")
    if not report.clusters:
        say(out, "No clusters. Start one with: gpuctl up")
        return
    cols = [Col("cluster"), Col("provider", drop=1), Col("state", drop=3), Col("uptime", True, drop=2),
            Col("$/h", True), Col("$ so far", True)]
    label = _labels(report.clusters)
    table(out, cols, [(label[c.id] + (" *" if c.is_default else ""), c.provider, c.state, duration(c.uptime_s),
                       usd(c.usd_per_hour), usd(c.usd)) for c in report.clusters])
    for c in report.clusters:
        g = c.guard or {}
        if c.note:
            say(out, f"  {label[c.id]}: {c.note}")
        if c.setup_failed:
            say(out, f"  {label[c.id]}: setup failed: {c.setup_failed}; fix that and run `gpuctl up` again (it sets the "
                     f"cluster up again with today's settings), or `gpuctl down {c.name}`")
        if g.get("error"):
            say(out, f"  {label[c.id]}: watchdog not reachable: {g['error']}")
            continue
        if g.get("watchdog_alive") is False:
            say(out, f"  {label[c.id]}: NO WATCHDOG RUNS (its last look was {duration(g.get('seen_s'))} ago): nothing "
                     f"ends this spend by itself; re-arm it with `gpuctl guard set --cluster {c.name}`")
        elif g.get("watchdog_alive"):
            say(out, f"  {label[c.id]}: watchdog pid {g.get('pid')}, last look {duration(g.get('seen_s'))} ago")
        if g.get("fired"):
            f = g["fired"]
            say(out, f"  {label[c.id]}: guard FIRED: {f['reason']} at {clock(f['at'], '%H:%M:%S')} ({f['detail']})"
                     f" -> {f['action']}")
        elif g.get("fires_at"):
            soon = ", ".join(f"{k} in {duration(v - now)}"
                             for k, v in sorted(g["fires_at"].items(), key=lambda kv: kv[1] or 0) if v)
            stalled = f"; stalled: {', '.join(g['stalled'])}" if g.get("stalled") else ""
            say(out, f"  {label[c.id]}: guards: {soon or 'none counting'}{stalled}")
        if g.get("idle_warning") and not g.get("fired"):
            say(out, f"  {label[c.id]}: WARNING: the notebook's kernels are idle: the idle guard fires at "
                     f"{clock(g['idle_warning'], '%H:%M:%S')} (in {duration(g['idle_warning'] - now)}); run a cell "
                     f"to keep it, or `gpuctl guard set --cluster {c.name} --idle 2h`")
    notebooks(getattr(report, "notebooks", ()), out)
    if not report.runs:
        return
    out.print()
    cols = [Col("run"), Col("cluster", drop=5), Col("state"), Col("TF", drop=2), Col("image", drop=1),
            Col("epoch", True, drop=6), Col("elapsed", True, drop=4), Col("$ on instance", True),
            Col("last metrics", wrap=True, drop=3)]
    rows = []
    for r in report.runs:
        state = r.state + (f" ({r.exit_code})" if r.state == "failed" else "")
        if r.state == "queued" and r.queue_position:
            state = f"queued ({ordinal(r.queue_position)})"
        rows.append((r.run_id, r.cluster, state, r.tensorflow or "-", _image_id(r.image),
                     f"{r.epoch}/{r.epochs_planned or '?'}", duration(r.elapsed_s), usd(r.usd), metrics(r.metrics)))
    table(out, cols, rows)
    say(out, RUN_DOLLARS_STATUS)
    for r in report.runs:
        if r.code and len(report.runs) == 1:  # `status RUN`: which code it ran
            say(out, f"  {r.run_id}: {code_text(r.code)}")
        if r.log_tail:
            out.print()
            node = f" on node {r.failed_node}" if r.failed_node is not None else ""
            say(out, (r.run_id, "bold"), f" {r.state}{node}; last lines of its log{node and ' there'}:")
            text_block(out, r.log_tail)
        if r.packages:
            made = f"installed in {duration(r.packages_s)}" if r.packages_s else "made by an earlier run"
            say(out, f"  {r.run_id}: packages: {r.packages}, {made}")
        if r.data_fetch_s is not None:
            got = f"{size_text(r.data_fetch_bytes or 0)} fetched" if r.data_fetch_bytes else "all of it cached there"
            say(out, f"  {r.run_id}: data: {clean(r.data or '', 200)}, {got} in {duration(r.data_fetch_s)}")
        if r.node_states:
            say(out, f"  {r.run_id}: nodes: " + ", ".join(f"{i} {st}" for i, st in enumerate(r.node_states)))
        story = history(r.segments, r.state)
        if story:
            say(out, f"  {r.run_id}: {story}")
        if r.resumable:
            say(out, f"  {r.run_id}: continue it from its last checkpoint: gpuctl train --resume {r.run_id}")


def code_text(code: CodeVersion) -> str:
    """"code 1a2b3c4d5e6f (git 0123456789ab, dirty)": the content hash of what was pushed, its
    commit, and whether what was pushed differs from that commit."""
    if not code.commit:
        return f"code {code.hash}"
    return f"code {code.hash} (git {code.commit[:12]}{', dirty' if code.dirty else ''})"


def _where(seg: SegmentCost) -> str:
    return f"{seg.instance_id}{f' in {seg.zone}' if seg.zone else ''}"


def history(segments: Sequence[SegmentCost], state: str) -> str:
    """Where a run went: "preempted at 14:02 in us-east-1a, resumed on i-... in us-east-1c after
    3m12s"; empty for a run that stayed on one instance and was not cut short there."""
    if not segments or (len(segments) == 1 and segments[0].end not in ("preempted", "lost")):
        return ""
    parts = []
    for prev, seg in zip(segments, segments[1:]):
        parts.append(f"{prev.end or 'ended'} at {clock(prev.ended_at or seg.started_at)}"
                     f"{f' in {prev.zone}' if prev.zone else ''}, resumed on {_where(seg)} after {duration(seg.waited_s)}")
    last = segments[-1]
    if last.end in ("preempted", "lost") and state in ("preempted", "lost"):
        parts.append(f"{last.end} at {clock(last.ended_at or 0)}{f' in {last.zone}' if last.zone else ''}; "
                     "waiting for recovery (gpuctl watch) or `train --resume`")
    return "; ".join(parts)


def segments(r: RunCost, out: Console) -> None:
    """The instances a run used, and what interruptions cost it."""
    if len(r.segments) < 2 and not r.lost_s:
        return
    cols = [Col("instance"), Col("zone", drop=3), Col("market", drop=2), Col("ran", True), Col("$", True),
            Col("ended", drop=4), Col("lost work", True, drop=1), Col("waited", True, drop=5)]
    table(out, cols, [(g.instance_id, g.zone or "-", g.market, duration(g.seconds),
                       usd(g.usd) + (" (free)" if g.free else ""), g.end or "running",
                       duration(g.lost_s) if g.lost_s else "-", duration(g.waited_s) if g.waited_s else "-")
                      for g in r.segments], note=False)
    free = " (not billed: EC2 interrupted a spot instance in its first hour)" if any(g.free for g in r.segments) else ""
    say(out, f"  {len(r.segments)} instances, {usd(r.instances_usd)} while on them; lost work {duration(r.lost_s)} "
             f"({usd(r.lost_usd)}{free}), {duration(r.waited_s)} waiting for a replacement")


def notebooks(sessions: tuple[NotebookSession, ...], out: Console) -> None:
    """The `gpuctl notebook` sessions, beside the runs: their time on the cluster, at its rate."""
    if not sessions:
        return
    out.print()
    cols = [Col("notebook session"), Col("cluster", drop=2), Col("time", True), Col("$/h", True, drop=1), Col("$", True)]
    table(out, cols, [(f"{clock(n.started_at)}-{clock(n.ended_at) if n.ended_at else 'open'}", n.cluster,
                       duration(n.seconds), usd(n.usd_per_hour), usd(n.usd)) for n in sessions])


def cost(report: CostReport, detailed: bool, out: Console | None = None) -> None:
    """Clusters, runs, and epoch tables (every run's if `detailed`, else the RECENT_RUNS newest)."""
    out = out or console()
    notes(report.notes)
    stored = (getattr(report, "images", None), getattr(report, "checkpoints", None), getattr(report, "volumes", None),
              getattr(report, "data", None))
    if not report.clusters and not report.runs and not any(
            s is not None and (getattr(s, "images", None) or getattr(s, "runs", None) or getattr(s, "volumes", None)
                               or getattr(s, "snapshots", None))
            for s in stored):
        # A fresh home: an empty header row tells a newcomer nothing; say what to do first.
        out.print("No runs yet. Start one with: gpuctl up, then gpuctl train PROJECT", markup=False, highlight=False)
        return
    cols = [Col("cluster"), Col("provider", drop=1), Col("state", drop=2), Col("uptime", True, drop=4),
            Col("$/h", True, drop=8), Col("$ compute", True, drop=7), Col("$ storage", True, drop=5),
            Col("$", True), Col("$ idle", True, drop=6), Col("$ spot saved", True, drop=3)]
    label = _labels(report.clusters)
    table(out, cols, [(label[c.id], c.provider, c.state, duration(c.uptime_s), usd(c.usd_per_hour), usd(c.compute_usd),
                       usd(c.storage_usd), usd(c.usd), usd(c.idle_usd), usd(c.spot_savings_usd))
                      for c in report.clusters])
    notebooks(report.notebooks, out)
    if not report.runs:
        images(getattr(report, "images", None), out)
        checkpoints(getattr(report, "checkpoints", None), out)
        render_volumes.storage(getattr(report, "volumes", None), out)
        render_snapshots.storage(getattr(report, "data", None), out)
        return
    out.print()
    cols = [Col("run"), Col("cluster", drop=5), Col("state", drop=6), Col("epochs", True, drop=7),
            Col("mean epoch", True, drop=3), Col("ex/s", True, drop=2), Col("$/M ex", True, drop=4),
            Col("$ epochs", True), Col("$ projected", True), Col("finish", True, drop=1)]
    rows = []
    for r in report.runs:
        finish = clock(r.projected_finish_at) if r.projected_finish_at else "-"
        spent = usd(r.spent_usd) + (" wall" if r.spent_from == "wall time" else "")
        rows.append((r.run_id, r.cluster, r.state, f"{r.epochs_done}/{r.epochs_planned or '?'}",
                     duration(r.mean_epoch_s), num(r.examples_per_s), usd(r.usd_per_million_examples),
                     spent, usd(r.projected_total_usd), finish))
    table(out, cols, rows)
    say(out, RUN_DOLLARS_COST)
    shown = report.runs if detailed else report.runs[-RECENT_RUNS:]
    hidden: list[str] = []
    for r in shown:
        out.print()
        hidden += [h for h in epochs(r, out) if h not in hidden]
    if hidden:  # once for all the epoch tables, not under each
        hidden_note(out, hidden, " in the epoch tables")
    if len(shown) < len(report.runs):
        out.print()
        say(out, f"(epoch tables of {len(report.runs) - len(shown)} older runs hidden: gpuctl cost --all, or name runs)")
    out.print()
    say(out, f"Total across clusters: {usd(report.total_usd)}")
    images(getattr(report, "images", None), out)
    checkpoints(getattr(report, "checkpoints", None), out)
    render_volumes.storage(getattr(report, "volumes", None), out)
    render_snapshots.storage(getattr(report, "data", None), out)


# The two run dollars count different things and differ for one run: say so under each table.
RUN_DOLLARS_STATUS = ("($ on instance: the run's whole time on its instances x their $/h, start-up included; "
                      "`gpuctl cost` counts its reported epochs only)")
RUN_DOLLARS_COST = ("($ epochs: the run's reported epochs only, or its whole time on its instances where it "
                    "reported none (marked wall); `gpuctl status` counts its whole time, start-up included)")


def images(storage: ImageStorage | None, out: Console) -> None:
    """The baked images' snapshot storage, under the clusters' total (it is no cluster's)."""
    if storage is None or not storage.images:
        return
    live = [i for i in storage.images if i.removed_at is None]
    say(out, f"Baked images: {len(live)} kept, {storage.gb:g} GB: {usd(storage.usd_per_month)}/month of snapshot "
             f"storage at {storage.price}; {usd(storage.accrued_usd)} so far"
             f"{f' (with {len(storage.images) - len(live)} removed)' if len(live) < len(storage.images) else ''}.")


def checkpoints(storage: CheckpointStorage | None, out: Console) -> None:
    """The runs' checkpoints in S3 (they outlive their clusters: no cluster's dollars either)."""
    if storage is None:
        return
    if storage.runs:
        runs = len({r.run_id for r in storage.runs})
        say(out, f"Checkpoints kept: {runs} run(s), {storage.gb:.3g} GB: {usd(storage.usd_per_month)}/month of S3 "
                 f"storage at {storage.price} (`gpuctl runs rm RUN` deletes a run's).")
    if storage.note:
        say(out, f"({storage.note})")


def epochs(r: RunCost, out: Console) -> list[str]:
    """One run's epoch table and its projection; the headers of the columns hidden to fit."""
    say(out, (r.run_id, "bold"), f" on {r.cluster}: {r.state}, {r.epochs_done}/{r.epochs_planned or '?'} epochs "
                                 f"at {usd(r.usd_per_hour)}/h" + (f"; {code_text(r.code)}" if r.code else ""))
    if r.data_fetch_s is not None:
        say(out, f"  its S3 data set was fetched in {duration(r.data_fetch_s)} before it started: "
                 f"{usd(r.data_fetch_usd or 0.0)} of the machine's time")
    if not r.epochs:
        if r.spent_from == "wall time":
            say(out, f"  no epoch reported{' yet' if r.state in ('starting', 'queued', 'running') else ''}: its "
                     f"{duration(r.wall_s)} on the instance cost {usd(r.spent_usd)} (a custom training loop reports "
                     "its epochs with gpuctl_report's `epoch`: docs/training.md)")
        else:
            say(out, "  no epoch reported yet")
        return []
    cols = [Col("epoch", True), Col("seconds", True, drop=2), Col("examples", True, drop=1),
            Col("ex/s", True, drop=3), Col("$ epoch", True), Col("$ cumulative", True),
            Col("metrics", wrap=True, drop=4)]
    hidden = table(out, cols, [(str(e.epoch), f"{e.seconds:.2f}", num(e.examples, "{:,}"), num(e.examples_per_s),
                                usd(e.epoch_cost_usd), usd(e.cumulative_usd), metrics(e.metrics)) for e in r.epochs],
                   note=False)
    say(out, f"  mean epoch {duration(r.mean_epoch_s)} / {usd(r.mean_epoch_usd)}; spent {usd(r.spent_usd)}; "
             f"projected total {usd(r.projected_total_usd)} ({usd(r.projected_remaining_usd)} still to run)")
    segments(r, out)
    return hidden


# (label, short label for the one-row-per-run view, drop order there, value)
def _image_id(image: str | None) -> str:
    """The AMI id of "name (ami-...)": names are long, ids are what `image ls` and `up --image` take."""
    if not image:
        return "-"
    return image.rsplit("(", 1)[-1].rstrip(")") if image.endswith(")") else image


_COMPARED: list[tuple[str, str, int, Callable[[RunCost], str]]] = [
    ("instance type", "type", 8, lambda r: r.instance_type or "-"),
    ("market", "market", 7, lambda r: r.market or "-"),
    ("$/h", "$/h", 9, lambda r: usd(r.usd_per_hour)),
    ("TensorFlow", "TF", 3, lambda r: r.tensorflow or "-"),
    ("image", "image", 1, lambda r: _image_id(r.image)),
    ("epochs", "epochs", 4, lambda r: f"{r.epochs_done}/{r.epochs_planned or '?'}"),
    ("epoch time", "epoch time", 6, lambda r: duration(r.mean_epoch_s)),
    ("$/epoch", "$/epoch", 0, lambda r: usd(r.mean_epoch_usd)),
    ("examples/s", "ex/s", 2, lambda r: num(r.examples_per_s)),
    ("$/M examples", "$/M ex", 5, lambda r: usd(r.usd_per_million_examples)),
    ("projected total", "projected", 0, lambda r: usd(r.projected_total_usd)),
]


def compare(report: CostReport, out: Console | None = None) -> None:
    """Runs side by side, one column each, while that fits; else one row per run."""
    out = out or console()
    cols = [Col("")] + [Col(r.run_id) for r in report.runs]
    rows = [(label, *[get(r) for r in report.runs]) for label, _, _, get in _COMPARED]
    if fit(cols, rows, out.width) is not None:
        table(out, cols, rows)
        return
    cols = [Col("run")] + [Col(short, right=short not in ("type", "market"), drop=drop)
                           for _, short, drop, _ in _COMPARED]
    table(out, cols, [(r.run_id, *[get(r) for *_, get in _COMPARED]) for r in report.runs])


CSV_COLUMNS = ["run_id", "cluster", "instance_type", "market", "epoch", "seconds", "examples", "examples_per_s",
               "epoch_cost_usd", "cumulative_usd"]


def cost_csv(report: CostReport, stream: TextIO | None = None) -> None:
    """One row per epoch of every run in the report."""
    writer = csv.writer(stream or sys.stdout)
    writer.writerow(CSV_COLUMNS)
    for r in report.runs:
        for e in r.epochs:
            writer.writerow([r.run_id, r.cluster, r.instance_type or "", r.market or "", e.epoch, f"{e.seconds:.3f}",
                             e.examples if e.examples is not None else "",
                             f"{e.examples_per_s:.3f}" if e.examples_per_s else "",
                             f"{e.epoch_cost_usd:.6f}", f"{e.cumulative_usd:.6f}"])

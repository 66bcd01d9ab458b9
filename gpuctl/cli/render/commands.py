"""Each command's own output, apart from status and cost (cli/render/cost.py): plain lines, the guard
table, config show, status --all. Tables follow the width rule of cli/render/__init__.py."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any, Sequence

import click
from rich.console import Console

from gpuctl.cli.render import Col, cell, clock, console, duration, notes, say, table, usd

if TYPE_CHECKING:
    from gpuctl.model.data import FetchStats
    from gpuctl.model.records import InstanceRecord, RunRecord, SettingValue, SyncStats
    from gpuctl.model.results import (
        DownResult,
        ExecResult,
        GuardCheck,
        GuardReport,
        Inventory,
        PullResult,
        SshConfigResult,
        StopResult,
        SyncResult,
        TrainResult,
        UpResult,
    )


def up(result: UpResult) -> None:
    max_hours = result.cluster.spec.max_hours  # the boot-time hard cap the provider armed
    rate = sum(i.usd_per_hour for i in result.instances)
    verb = "was already up; reused" if result.reused else "is up"
    click.echo(f"Cluster {result.cluster.name!r} {verb} ({result.cluster.provider}, {len(result.instances)} "
               f"instance(s), {usd(rate)}/h); it is the default for later commands.")
    for i in result.instances:
        if i.region:
            click.echo(f"  {i.id}: {i.instance_type} {i.market} in {i.zone}, {i.public_ip or 'no public IP'}, "
                       f"{usd(i.usd_per_hour)}/h ({i.price_source})")
            kind = f", {i.image_kind}" if i.image_kind else ""
            click.echo(f"  image {i.image_name or '?'} ({i.image_id}{kind}); powers itself off {max_hours:g} h after boot")
    for env in result.tensorflow:
        how = {"installed": f"installed by the setup step in {env.seconds:.0f} s", "ready": "gpuctl's env, ready",
               "found": "the image's own", "remote.python": "remote.python"}.get(env.how, env.how)
        click.echo(cell(f"  TensorFlow {env.tensorflow or '?'} on {env.host}: {env.python} ({how})"))
    example = ("examples/multiworker" if len(result.instances) > 1 else
               "examples/cifar10 -- --data digits --epochs 2")
    click.echo(f"Next: gpuctl train PROJECT   (e.g. gpuctl train {example})")


def still_running(instances: Sequence["InstanceRecord"]) -> list[str]:
    """After an `up` that failed or was interrupted: the instances it leaves running, what they
    bill (spot: the price now and the cap it may rise to) and the `down` that ends them, in two
    lines; none when nothing runs."""
    from gpuctl.model.records import ENDED_STATES

    left = sorted((i for i in instances if i.state not in ENDED_STATES), key=lambda i: i.node)
    if not left:
        return []
    ids = ", ".join(i.id for i in left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
    kind = f"{left[0].instance_type} {left[0].market}" if left[0].instance_type else ""  # machines gpuctl rented
    now = sum(i.usd_per_hour for i in left)
    most = sum(max(i.usd_per_hour, i.max_usd_per_hour or 0.0) for i in left)
    money = ""
    if most > 0:
        money = f"{usd(now)}/h" + (f" now, up to {usd(most)}/h" if most > now else "") + (" in all" if len(left) > 1 else "")
    what = ": ".join(x for x in (f"{len(left)} x {kind}" if kind and len(left) > 1 else kind, money) if x)
    return [cell(f"Still {'running' if most > 0 else 'up'}: {ids}" + (f" ({what})" if what else "")),
            cell(f"End {'it' if len(left) == 1 else 'them'} with: gpuctl down {left[0].cluster} -y")]


def _left_out(what: str, items: Sequence[str]) -> None:
    """Entries a push or pull left out (links leading out, special files), on stderr."""
    if items:
        items = sorted(items)
        more = f" (+{len(items) - 5} more; --json lists them all)" if len(items) > 5 else ""
        click.echo(cell(f"warning: {what} ({len(items)}): {'; '.join(items[:5])}{more}"), err=True)


def _not_pushed(label: str, st: SyncStats) -> None:
    _left_out(f"{label} entries not pushed", st.skipped)
    # Private entries (the gpuctl home, ~/.ssh, ~/.aws): left out whatever the ignore files say.
    _left_out(f"{label} entries refused (private, never pushed)", st.refused)


def train_started(result: TrainResult, to_stderr: bool) -> None:
    """With --wait these go to stderr: stdout is the run's log."""
    for label, st in (("code", result.code_sync), ("data", result.data_sync)):
        if st is not None:
            click.echo(f"Pushed {label}: {st.files_copied} of {st.files_total} files, {st.bytes_copied:,} bytes "
                       f"sent in {st.seconds:.2f}s.", err=to_stderr)
            _not_pushed(label, st)
    if result.data_fetch is not None:
        click.echo(fetched_text(result.data_fetch), err=to_stderr)
    run = result.run
    if run.state == "queued":
        from gpuctl.payloads.gpuctl_queue import ordinal

        place = f" ({ordinal(run.queue_position)} in line)" if run.queue_position else ""
        free = (f"{run.gpus} GPU(s) are free" if result.node_gpus != 0 else
                "the node's one slot is free (no GPU there: its runs go one at a time)")
        click.echo(f"Run {run.run_id} queued on {run.cluster}{place}: it starts on the instance when {free}, "
                   f"whether or not this laptop is on ({result.host}, tmux session {result.session}).", err=to_stderr)
    else:
        beside = " beside the runs already there (--now)" if run.now else ""
        click.echo(f"Run {run.run_id} started on {run.cluster}{beside} ({result.host}, tmux session {result.session}).",
                   err=to_stderr)
    if not to_stderr:
        click.echo(f"Follow it: gpuctl logs -f {run.run_id}")


def fetched_text(st: FetchStats) -> str:
    """"Fetched data: 3 of 10 files (12.3 MB) in 1.20s, 7 already on the host (-> DIR)."."""
    from gpuctl.model.data import size_text

    kept = f", {st.cached:,} already on the host" if st.cached else ""
    again = f", {len(st.changed_again)} changed meanwhile and fetched again" if st.changed_again else ""
    return (f"Fetched data: {st.fetched:,} of {st.files_total:,} files ({size_text(st.fetched_bytes)}) in "
            f"{st.seconds:.2f}s{kept}{again}.")


def synced(result: SyncResult) -> None:
    for label, st, where in (("code", result.code, result.code_dir), ("data", result.data, result.data_dir)):
        if st is not None:
            click.echo(f"{label}: {st.files_copied} of {st.files_total} files, {st.bytes_copied:,} bytes sent, "
                       f"{st.files_deleted} deleted, {st.seconds:.2f}s -> {where}")
            _not_pushed(label, st)


def pulled(result: PullResult) -> None:
    click.echo(f"Pulled {result.files} file(s) of {result.run_id} into {result.dest}")
    for name in result.left_out:
        click.echo(f"Left out {name}: the run's copy of its data set, which stays where it came from (--data).")
    _left_out("entries not pulled", result.skipped)


def down(result: DownResult, everything: bool) -> None:
    if result.already_down:
        what = "No cluster is up" if everything or not result.cluster else f"Cluster {result.cluster!r} is already down"
        click.echo(f"{what}; nothing to do.")
        return
    click.echo(
        f"{'Everything' if everything else 'Cluster ' + repr(result.cluster)} is down: released "
        f"{len(result.released)} resource(s), {len(result.released_instances)} of them instances or work dirs; "
        f"stopped {len(result.stopped_runs)} run(s). Reports stay: gpuctl cost"
    )
    if result.unconfirmed_runs:
        click.echo(f"Not confirmed stopped before the release ({result.unconfirmed_why}): "
                   f"{', '.join(result.unconfirmed_runs)}; their last epochs and logs may be missing.")


def stopped(result: StopResult) -> None:
    if result.already_ended is not None:
        run = result.already_ended
        click.echo(f"Run {run.run_id} already ended ({run.state}); nothing to stop.")
        return
    if not result.stopped:
        click.echo(f"No run is running on cluster {result.cluster!r}; nothing to stop.")
        return
    for run in result.stopped:
        if run.run_id in result.dequeued:  # it never started: no signal, no checkpoint to resume from
            click.echo(f"Took run {run.run_id} out of cluster {result.cluster!r}'s queue before it started; "
                       "it cost nothing. To run it after all, train it again.")
            continue
        click.echo(f"Stopped run {run.run_id} on cluster {result.cluster!r} (SIGTERM, then SIGKILL after "
                   f"{result.grace_s:g} s; exit code {run.exit_code}). Resume it: gpuctl train --resume {run.run_id}")
    click.echo(f"Cluster {result.cluster!r} stays up (billed until `gpuctl down`).")


def detached(run: RunRecord) -> None:
    """Ctrl-C while following a run: it goes on (and bills); say where, and how to end it."""
    if run.state == "queued":  # it waits on the instance, at no cost of its own yet
        click.echo(f"Detached: run {run.run_id} stays queued on cluster {run.cluster!r} and starts there when "
                   f"its GPUs are free; take it out with: gpuctl stop {run.run_id}", err=True)
        return
    click.echo(f"Detached: run {run.run_id} keeps running on cluster {run.cluster!r} at "
               f"{usd(run.usd_per_hour)}/h; stop it with: gpuctl stop {run.run_id}", err=True)


def exec_output(results: Sequence[ExecResult]) -> None:
    for r in results:
        prefix = f"[{r.host}] " if len(results) > 1 else ""
        for line in r.stdout.splitlines():
            click.echo(prefix + line)
        for line in r.stderr.splitlines():
            click.echo(prefix + line, err=True)


def ssh_config(result: SshConfigResult, install: bool) -> None:
    click.echo(f"Wrote {result.path} ({', '.join(result.hosts) or 'no hosts'}).")
    if result.included_from:
        click.echo(f"Included from {result.included_from}: "
                   f"`ssh {result.hosts[0] if result.hosts else 'CLUSTER'}` works.")
    elif not install:
        click.echo(f"Add `Include {result.path}` at the top of ~/.ssh/config, or rerun with --install.")


def config_values(values: Sequence[SettingValue], out: Console | None = None) -> None:
    rows = [(v.key, json.dumps(v.value), short_path(v.source)) for v in values]
    table(out or console(), [Col("setting"), Col("value", wrap=True), Col("source", wrap=True)], rows)


def short_path(text: str) -> str:
    """A file path as a user would type it (`~/...`, or relative to here); other text as is.
    Paths do not wrap, so a shorter one keeps `config show` a table at 80 columns."""
    if not text.startswith(os.sep):
        return text
    for base, shown in ((os.getcwd(), ""), (os.path.expanduser("~"), "~" + os.sep)):
        if base != os.sep and text.startswith(base.rstrip(os.sep) + os.sep):
            return shown + text[len(base.rstrip(os.sep)) + 1:]
    return text


def inventory(inv: Inventory, out: Console | None = None) -> None:
    out = out or console()
    if not inv.resources:
        out.print("Nothing of gpuctl's is running anywhere it looked.")
    else:
        cols = [Col("provider", drop=3), Col("kind", drop=4), Col("id"), Col("region", drop=1),
                Col("cluster"), Col("state", drop=2), Col("in ledger")]
        rows = [(r.provider, r.kind, r.id, r.region or "-", r.cluster or "-", r.state or "-",
                 "yes" if r.cluster in inv.ledger_clusters else "NO") for r in inv.resources]
        table(out, cols, rows)
    for note in inv.notes:
        click.echo(note, err=True)


def guard(report: GuardReport, out: Console | None = None, now: float | None = None) -> None:
    """Each guard, its limit, and the time until it fires."""
    out = out or console()
    cfg, st = report.config, report.state
    now = time.time() if now is None else now
    action = cfg.get("poweroff_command") if cfg.get("on_fire") == "poweroff" else "gpuctl jobs only"
    say(out, f"Cluster {report.cluster!r}: on fire -> {cfg.get('on_fire', '?')} ({action})")
    guards = [
        ("idle", cfg.get("idle_s"), "no job, idle GPU, no interactive SSH login"),
        ("stall", cfg.get("stall_s"), f"job hung -> {cfg.get('on_stall', 'warn')}"),
        ("budget", cfg.get("budget_usd"), f"the cluster's uptime: {usd(st.get('spent_usd', 0))} so far"),
        ("run-done", cfg.get("grace_s") if cfg.get("down_after_run") else 0, "after the run (train --down)"),
        ("hard-cap", cfg.get("hard_cap_at"), "max_hours after launch"),
    ]
    rows = []
    for name, limit, what in guards:
        if not limit:
            rows.append((name, "off", "", ""))
            continue
        at = (st.get("fires_at") or {}).get(name)
        when = f"fires in {duration(at - now)}" if at and at > now else ("due" if at else "not counting")
        shown = usd(limit) if name == "budget" else clock(limit) if name == "hard-cap" else duration(limit)
        rows.append((name, shown, when, what))
    for run_id, budget in sorted(report.run_budgets.items()):
        rows.append(("run budget", usd(budget), "", f"{run_id}'s own epochs (train --budget)"))
    table(out, [Col("guard"), Col("limit"), Col("fires"), Col("what", wrap=True, drop=1)], rows)
    logins = st.get("logins") or {}
    if logins.get("counted") or logins.get("ignored"):
        held = ", ".join(f"{e.get('user')}@{e.get('line')} from {e.get('host') or '?'}" for e in logins.get("counted", []))
        why: dict[str, int] = {}
        for e in logins.get("ignored", []):
            why[e.get("why", "?")] = why.get(e.get("why", "?"), 0) + 1
        skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(why.items()))
        say(out, f"logins: {held or 'none counted'}" + (f" (not counted: {skipped})" if skipped else ""))
    if st.get("stalled"):
        say(out, f"STALLED (GPU idle, log silent): {', '.join(st['stalled'])}")
    fired = st.get("fired")
    if fired:
        say(out, f"FIRED: {fired['reason']} at {clock(fired['at'], '%H:%M:%S')}: {fired['detail']} -> {fired['action']}")
    for check in report.checks:
        _guard_check(out, check, cfg)
    notes(report.notes)


def _guard_check(out: Console, check: GuardCheck, cfg: dict[str, Any]) -> None:
    """One dry look on one host: what the watchdog sees and would decide now, and its probes."""
    r = check.result
    out.print()
    say(out, (f"Check on {check.host}", "bold"), " (one look now by the watchdog's own code; nothing changed):")
    if r.get("error"):
        say(out, f"  could not look: {r['error']}")
        return
    st, wd, pr = r.get("state") or {}, r.get("watchdog") or {}, r.get("probes") or {}
    now = r.get("now") or time.time()
    if wd.get("alive"):
        say(out, f"  watchdog: pid {wd.get('pid')}, last look {duration(now - (wd.get('last_look') or now))} ago")
    else:
        say(out, "  watchdog: NOT RUNNING: nothing ends this spend by itself; re-arm it with `gpuctl guard set`")
    gpu = st.get("gpu_util")
    say(out, f"  jobs running: {', '.join(st.get('jobs') or []) or 'none'}; GPU: "
             + ("no nvidia-smi answer (counts as idle)" if gpu is None else f"{gpu:.0f}% (idle under "
                f"{cfg.get('gpu_idle_percent', 5):g}%)"))
    logins = st.get("logins") or {}
    counted = ", ".join(f"{e.get('user')}@{e.get('line')} (no input for {duration(e.get('quiet_s'))})"
                        for e in logins.get("counted") or [])
    say(out, f"  interactive logins counted: {counted or 'none'}"
             + ("" if logins.get("utmp") else " (no utmp on this host: logins cannot be seen)"))
    say(out, f"  gpuctl commands at work: {', '.join(st.get('busy') or []) or 'none'}")
    if st.get("idle_since"):
        say(out, f"  idle since {duration(now - st['idle_since'])} ago")
    if st.get("stalled"):
        say(out, f"  stalled: {', '.join(st['stalled'])}")
    say(out, f"  would fire now: {r['would_fire']} ({r.get('detail')})" if r.get("would_fire")
        else "  would fire now: nothing")
    smi = pr.get("nvidia_smi")
    say(out, f"  probes: python {pr.get('python')}; utmp {pr.get('utmp') or 'none'}; nvidia-smi {smi or 'missing'}; "
             f"systemd {'yes' if pr.get('systemd') else 'no'}")
    if cfg.get("on_fire") == "poweroff":
        ok = pr.get("poweroff_found") and pr.get("sudo_without_password") is not False
        say(out, f"  poweroff: `{cfg.get('poweroff_command')}` "
                 + ("can run" if ok else "WOULD FAIL: " + ("command not found" if not pr.get("poweroff_found")
                                                          else "sudo asks for a password")))

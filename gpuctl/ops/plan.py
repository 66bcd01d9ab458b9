"""`gpuctl plan`: which machine trains this project for the least money, measured on the project.

Each machine named (`--type T`: a probe cluster launched for it; `--cluster C`: one that is up) runs
the project for K epochs at once (probes.py), the figures become a projection for N epochs
(projection.py), and the rows are ranked by projected dollars. `--from-history` ranks this
project's past runs instead, launching nothing.

Everything a user can get wrong is refused by `check` before anything is launched: the project,
the numbers, an unknown type (with the provider's did-you-mean), a cluster that is down, and a
worst case (each probe's $/h x the hours it may bill) above `--max-usd`.
"""

from __future__ import annotations

import re
import secrets
import shlex
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gpuctl.config.settings import parse_duration
from gpuctl.errors import CloudError, ConfigError, NotFoundError, RunFailedError
from gpuctl.model.results import PlanReport, PlanRow
from gpuctl.ops.latest_plan import remember_plan
from gpuctl.ops import clusters, costs, push
from gpuctl.ops.probes import ProbeJob, Target, figures, probe
from gpuctl.ops.projection import STARVED_PERCENT, Measured, bounded, rank, starved
from gpuctl.ops.session import Progress, Session, quiet, serialized
from gpuctl.provision import provider_class

PROBE_HARD_CAP_H = 1.0  # a probe cluster powers off after this at the latest
MIN_PROBE_TIMEOUT_S = 60.0  # less measures nothing: a launch alone takes longer
MAX_EPOCHS = 1_000_000


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked `gpuctl plan` for."""

    project: Path
    epochs: int
    types: tuple[str, ...] = ()
    clusters: tuple[str, ...] = ()
    spot: Optional[bool] = None  # None: the `aws.market` setting
    probe_epochs: int = 2
    max_usd: float = 2.0
    probe_timeout: str = "30m"
    args: tuple[str, ...] = ()
    data: Optional[Path] = None
    allow_cpu: bool = False


@dataclass(frozen=True)
class CheckedPlan:
    """A plan whose inputs were all checked and whose probes were priced; nothing exists yet."""

    job: ProbeJob
    targets: tuple[Target, ...]
    worst_case_usd: float
    question: Optional[str]  # what to confirm before launching (None: nothing is launched)


def _numbers(req: PlanRequest) -> float:
    """The request's numbers checked; --probe-timeout in seconds."""
    if req.probe_epochs < 1:
        raise ConfigError(f"--probe-epochs {req.probe_epochs}: a probe must measure at least one epoch",
                          "Leave it at 2 (the first epoch includes compilation and warm-up, the second is steady).")
    if req.epochs < req.probe_epochs or req.epochs > MAX_EPOCHS:
        raise ConfigError(f"--epochs {req.epochs} is " + ("below --probe-epochs " + str(req.probe_epochs)
                                                         if req.epochs < req.probe_epochs else "not a run length"),
                          "Give the epochs the whole run will train (--epochs N), at least --probe-epochs.")
    if not (bounded(req.max_usd, 1e6) is not None):
        raise ConfigError(f"--max-usd {req.max_usd!r} is not an amount of dollars", "Give a number like 2 or 5.50.")
    try:
        timeout = parse_duration(req.probe_timeout)
    except ValueError:
        timeout = 0.0
    if not MIN_PROBE_TIMEOUT_S <= timeout <= 86400:
        raise ConfigError(f"--probe-timeout {req.probe_timeout!r} is not a duration of 1 minute to a day",
                          "Give one like 20m or 1h (a probe still running then is stopped; a bare number is seconds).")
    return timeout


def _probe_name(plan_id: str, instance_type: str) -> str:
    """`plan-1a2b-g5-xlarge`: a cluster name (no dots) a user recognises in `status` and `cost`."""
    return f"plan-{plan_id}-{re.sub(r'[^A-Za-z0-9]+', '-', instance_type).strip('-')[:28] or 'type'}"


def check(s: Session, req: PlanRequest) -> CheckedPlan:
    """Every input checked, every probe named and priced, the worst case against --max-usd;
    creates nothing."""
    if not req.types and not req.clusters:
        raise ConfigError("nothing to probe", "Name machine types (--type g5.xlarge, repeatable), clusters that are "
                                              "up (--cluster NAME), or rank past runs with --from-history.")
    timeout = _numbers(req)
    project, _, _ = push.check_project(s, req.project)
    data = push.check_data(req.data)
    targets = [_cluster_target(s, name, timeout) for name in dict.fromkeys(req.clusters)]
    if req.types:
        targets += _type_targets(s, tuple(dict.fromkeys(req.types)), req.spot, timeout)
    worst = sum(t.worst_rate * t.cap_hours for t in targets)
    if worst > req.max_usd:
        each = ", ".join(f"{t.label} ${t.worst_rate:,.4f}/h x {t.cap_hours:g} h" for t in targets)
        raise ConfigError(f"the plan's worst case, ${worst:,.2f} ({each}), is above --max-usd ${req.max_usd:,.2f}",
                          "Raise --max-usd, probe fewer machines, or a shorter --probe-timeout on clusters that are up.")
    job = ProbeJob(project=project, args=tuple(req.args), data=data, allow_cpu=req.allow_cpu,
                   probe_epochs=req.probe_epochs, epochs=req.epochs, timeout_s=timeout)
    launched = [t for t in targets if t.source == "type"]
    question = None
    if launched:
        what = ", ".join(f"{t.label} at ${t.usd_per_hour:,.4f}/h" for t in launched)
        question = (f"launch {len(launched)} probe cluster(s) ({what}) to run {project.name} for {req.probe_epochs} "
                    f"epoch(s) on each, released when measured; worst case ${worst:,.2f} (each probe's most $/h, "
                    f"a spot one's cap, x its {launched[0].cap_hours:g} h hard cap; --max-usd ${req.max_usd:,.2f})")
    return CheckedPlan(job=job, targets=tuple(targets), worst_case_usd=worst, question=question)


def _cluster_target(s: Session, name: str, timeout_s: float) -> Target:
    cluster = s.resolve_cluster(name)  # NotFoundError for a cluster that is down: before any launch
    rate = costs.cluster_cost(s, cluster, time.time())[0].usd_per_hour
    itype = next((i.instance_type for i in s.ledger.instances(cluster.id) if i.instance_type), None)
    return Target(source="cluster", label=f"cluster {cluster.name}", cluster=cluster.name, provider=cluster.provider,
                  usd_per_hour=rate, cap_hours=timeout_s / 3600.0, instance_type=itype)


def _type_targets(s: Session, types: tuple[str, ...], spot: bool | None, timeout_s: float) -> list[Target]:
    settings = s.settings().settings
    if not provider_class(settings.provider).capabilities.picks_instance_types:
        raise ConfigError(f"--type launches machines of a type; the {settings.provider} provider's machines are what "
                          "they are", "Probe clusters that are up with --cluster NAME, or launch on aws "
                                      "(--provider aws, or GPUCTL_PROVIDER=aws).")
    cap = min(PROBE_HARD_CAP_H, settings.guards.max_hours)
    if timeout_s > cap * 3600:
        raise ConfigError(f"--probe-timeout is longer than a probe cluster's hard cap ({cap:g} h)",
                          "Give a shorter one, e.g. 30m.")
    plan_id = secrets.token_hex(2)
    out = []
    for itype in types:
        flags = {**s.flags, "cluster": _probe_name(plan_id, itype), "aws.instance_type": itype,
                 "guards.max_hours": cap,
                 # A probe needs no checkpoints, nor the S3 store and role that keep them.
                 "aws.checkpoints": "instance", "train.checkpoint": "off"}
        if spot is not None:
            flags["aws.market"] = "spot" if spot else "on-demand"
        spec, quote = clusters.priced(Session(s.home, flags, s.env))  # an unknown type: did-you-mean, here
        market = quote.market if quote is not None else ("spot" if spec.interruptible else "on-demand")
        rate = quote.usd_per_hour if quote is not None else 0.0
        # A spot price is the price now, in the cheapest zone: the launch may land in a dearer zone
        # and the price may rise, up to the cap (the on-demand price unless --max-price).
        out.append(Target(source="type", label=f"{itype} {market}", cluster=spec.name, provider=spec.provider,
                          usd_per_hour=rate, cap_hours=cap, instance_type=itype, market=market, flags=flags,
                          worst_usd_per_hour=quote.worst_usd_per_hour if quote is not None else rate))
    return out


def run(s: Session, checked: CheckedPlan, progress: Progress = quiet,
        cancel: threading.Event | None = None) -> PlanReport:
    """Every probe at once, each released when measured; the ranked report. Ctrl-C (a
    KeyboardInterrupt here) stops the probes, releases their clusters, then goes on up."""
    cancel = cancel or threading.Event()
    one_at_a_time = serialized(progress)

    def said_by(label: str) -> Progress:
        return lambda line: one_at_a_time(f"{label}: {line}")

    pool = ThreadPoolExecutor(max_workers=len(checked.targets), thread_name_prefix="gpuctl-probe")
    futures = [pool.submit(probe, s, checked.job, t, said_by(t.label), cancel) for t in checked.targets]
    try:
        while not all(f.done() for f in futures):
            wait_all(futures, timeout=0.5)
    except KeyboardInterrupt:
        cancel.set()
        one_at_a_time("interrupted: stopping the probes and releasing their clusters before exiting")
        wait_all(futures)
        raise
    finally:
        pool.shutdown(wait=True)
    rows = [f.result() for f in futures]
    done = report(checked.job, rows, checked.worst_case_usd)
    remember_plan(s, done)  # for `gpuctl dashboard`
    return done


def report(job: ProbeJob, rows: list[PlanRow], worst_case_usd: float = 0.0) -> PlanReport:
    """The rows ranked, with the hints and the recommendation."""
    ranked = rank(rows)
    notes = []
    for r in ranked:
        if starved(r):
            notes.append(f"{r.label}: the GPU was busy {r.gpu_util_percent:.0f}% of its steady epochs (under "
                         f"{STARVED_PERCENT:.0f}%): the input pipeline is the bottleneck; try tf.data's cache() and "
                         "prefetch(tf.data.AUTOTUNE), and more parallel loading (num_parallel_calls)")
        if r.outcome == "ok" and not r.steady_epochs:
            notes.append(f"{r.label}: one epoch only, compilation and warm-up included, stands for the steady ones "
                         "(--probe-epochs 2 or more measures them)")
    best = ranked[0] if ranked and ranked[0].rank == 1 else None
    return PlanReport(project=str(job.project), epochs=job.epochs, probe_epochs=job.probe_epochs, rows=ranked,
                      recommendation=_command(best, job) if best else None,
                      plan_usd=sum(r.probe_usd for r in rows), worst_case_usd=worst_case_usd, notes=tuple(notes))


def raise_for(report: PlanReport) -> None:
    """After the report is shown: a non-zero exit when a probe cluster still bills, or when no
    machine was measured (scripts must not read an empty ranking as success)."""
    left = [r for r in report.rows if not r.released]
    if left:
        raise CloudError(f"{len(left)} probe cluster(s) could not be released and still bill: "
                         f"{', '.join(r.cluster for r in left)}",
                         "Release them: " + "; ".join(f"gpuctl down {r.cluster} -y" for r in left)
                         + " (or `gpuctl down --all -y`).")
    if report.rows and not any(r.rank for r in report.rows):
        raise RunFailedError("no machine was measured: every probe ended without a projection (see the rows above)",
                             "Fix what the rows say, then plan again.")


def _command(row: PlanRow, job: ProbeJob) -> str:
    """The commands that run the whole thing on the row's machine."""
    train = ["gpuctl", "train", str(job.project), *(["--data", str(job.data)] if job.data else []),
             *(["--allow-cpu"] if job.allow_cpu else [])]
    tail = ["--", *job.args] if job.args else []
    if row.source == "cluster" or row.instance_type is None:
        return shlex.join([*train, "--cluster", row.cluster, *tail])
    market = ["--spot"] if row.market == "spot" else ["--on-demand"]
    return f"{shlex.join(['gpuctl', 'up', '--type', row.instance_type, *market])} && {shlex.join([*train, *tail])}"


def from_history(s: Session, project: Path, epochs: int) -> PlanReport:
    """Rank this project's past runs (the newest on each machine) for `epochs` epochs, launching
    nothing. Their ready time is the script's start-up only (the run's start to its first epoch):
    a past launch's time is not recorded."""
    if epochs < 1 or epochs > MAX_EPOCHS:
        raise ConfigError(f"--epochs {epochs} is not a run length", "Give the epochs the whole run will train.")
    path = push.check_project(s, project)[0]
    newest: dict[tuple[str, str], PlanRow] = {}
    for run in s.ledger.runs():
        found = s.ledger.epochs(run.run_id) if run.project == str(path) else []
        if not found:
            continue
        cluster = s.ledger.cluster(run.cluster_id)
        inst = next(iter(s.ledger.instances(cluster.id)), None)
        itype = inst.instance_type if inst is not None else None
        market = inst.market if inst is not None else None
        label = f"{itype} {market}" if itype else f"cluster {cluster.name}"
        row = PlanRow(label=label, source="history", cluster=cluster.name, provider=cluster.provider,
                      instance_type=itype, market=market if itype else None, run_id=run.run_id,
                      run_started_at=run.started_at, usd_per_hour=run.usd_per_hour)
        startup = bounded(found[0].start - run.started_at) or 0.0
        newest[(label, market or "")] = figures(row, Measured(found), startup, epochs)
    if not newest:
        raise NotFoundError(f"no past run of {path} reported an epoch",
                            f"Measure it instead: gpuctl plan {shlex.quote(str(project))} --type g5.xlarge ... "
                            "(or --cluster NAME).")
    job = ProbeJob(project=path, args=(), data=None, allow_cpu=False, probe_epochs=0, epochs=epochs, timeout_s=0)
    done = report(job, list(newest.values()))
    remember_plan(s, done)  # for `gpuctl dashboard`
    return done

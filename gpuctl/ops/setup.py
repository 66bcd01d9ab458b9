"""The TensorFlow a cluster's runs use: found on the host, or installed by the setup step.

`up` (on a host gpuctl reaches over SSH), `train` and `image bake` call `ensure`. What it picks,
in order: `remote.python` as set (nothing checked or installed); gpuctl's env for the version,
made earlier or baked into the image; an image's own TensorFlow of that version (a DLAMI's
/opt/tensorflow); else the setup step makes the env (payloads/gpuctl_setup.py): a venv with
tensorflow[and-cuda] (tensorflow-cpu on a host without a GPU) and tf-keras of that version.
"""

from __future__ import annotations

import posixpath
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator, Literal, TypeVar

from gpuctl.errors import ConfigError, GpuctlError, RemoteError
from gpuctl.model.records import ClusterRecord, InstanceRecord
from gpuctl.model.results import TfEnv
from gpuctl.ops import guards
from gpuctl.ops.session import Progress, Session, each, quiet
from gpuctl.payloads.gpuctl_setup import matches
from gpuctl.provision import TF_VERSION
from gpuctl.remote import preflight, tf_env
from gpuctl.remote.host import Host, NodeFacts

T = TypeVar("T")
NO_NETWORK = "no network to the package index"  # how the setup payload starts that error


def version_of(cluster: ClusterRecord, asked: str | None = None) -> str:
    """The version a command works with: asked (train's settings), else the cluster's, else the tested one."""
    from gpuctl.config.settings import TESTED_TENSORFLOW  # here: a report never needs the settings' models

    version = asked or cluster.spec.tensorflow or TESTED_TENSORFLOW
    if not TF_VERSION.fullmatch(version):  # it names a directory on the host
        raise ConfigError(f"--tf {version!r} is not a TensorFlow version", "Give one like 2.21 or 2.21.0.")
    return version


def ensure(s: Session, cluster: ClusterRecord, progress: Progress = quiet, version: str | None = None,
           check: bool = True, install: bool = True, recheck: bool = False) -> tuple[TfEnv, ...]:
    """Every host of the cluster gets a Python with TensorFlow `version` (its `python` in this
    command's facts, `Session.facts`);
    with `check`, the preflight payload then reports what that Python sees (GPU, CUDA): kept on
    the host per environment, looked at anew when the environment changed or with `recheck`.
    Without `install`, a host that has none is an error instead of a setup step."""
    version = version_of(cluster, version)
    pairs = s.hosts(cluster)
    envs = _recorded(s, cluster, install, lambda: tuple(each(
        pairs, lambda p: _one(cluster, p[1], s.facts(p[1]), version, install, progress))))
    if check:
        envs = _recorded(s, cluster, install, lambda: _preflights(s, cluster, pairs, envs, progress, recheck))
    if install and failed(s, cluster) is not None:
        s.ledger.event(DONE, ", ".join(f"{e.host}: {e.how}" for e in envs), cluster=cluster)
    return envs


@contextmanager
def looking(s: Session, cluster: ClusterRecord, envs: tuple[TfEnv, ...], progress: Progress = quiet,
            recheck: bool = False) -> Iterator[Callable[[], tuple[TfEnv, ...]]]:
    """Each remote host's preflight (ensure's `check`, after an ensure without it) in the
    background while the block runs (`train` pushes the code meanwhile); what the block is given
    waits for it and returns `envs` with their reports. The ledger (SQLite) stays in the calling
    thread. A block that fails waits for the preflight (nothing uses the connections after it) and
    still records the preflight's failure; Ctrl-C closes the connections instead, which ends the
    preflight's wait at once (its host process only keeps an answer)."""
    pairs = s.hosts(cluster)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpuctl-preflight")
    job = pool.submit(_preflights, s, cluster, pairs, envs, progress, recheck)
    try:
        yield lambda: _recorded(s, cluster, True, job.result)
    except Exception:
        futures.wait([job])
        failed_too = job.exception()
        if isinstance(failed_too, GpuctlError):
            s.ledger.event(FAILED, failed_too.message, cluster=cluster)
        raise
    except BaseException:
        for _, host in pairs:
            host.close()
        raise
    finally:
        pool.shutdown(wait=False)


def _preflights(s: Session, cluster: ClusterRecord, pairs: list[tuple[InstanceRecord, Host]], envs: tuple[TfEnv, ...],
                progress: Progress, recheck: bool) -> tuple[TfEnv, ...]:
    by_label = {e.host: e for e in envs}
    return tuple(each(pairs, lambda p: _preflight(cluster, p[1], s.facts(p[1]), by_label[p[1].label], progress,
                                                  recheck)))


def _recorded(s: Session, cluster: ClusterRecord, install: bool, step: Callable[[], T]) -> T:
    """step(); a failure is the cluster's setup failing, when this command sets up (`install`):
    `status` says so until a setup works (`gpuctl up` again tries with today's settings)."""
    try:
        return step()
    except GpuctlError as exc:
        if install:
            s.ledger.event(FAILED, exc.message, cluster=cluster)
        raise


FAILED, DONE = "setup-failed", "setup"  # the ledger's events: the latest says how the cluster's setup stands


def failed(s: Session, cluster: ClusterRecord) -> str | None:
    """Why the cluster's last setup step failed; None when it worked (or never ran)."""
    last = s.ledger.last_event(cluster.id, (FAILED, DONE))
    return last[1] if last is not None and last[0] == FAILED else None


def done_by_remote_python(s: Session, cluster: ClusterRecord) -> None:
    """`remote.python` set: nothing is set up, so nothing failed (an earlier failure is over)."""
    if failed(s, cluster) is not None:
        s.ledger.event(DONE, f"remote.python = {cluster.spec.remote.python}", cluster=cluster)


def _one(cluster: ClusterRecord, host: Host, facts: NodeFacts, version: str, install: bool,
         progress: Progress) -> TfEnv:
    if host.local:  # this machine is what it is: the Python running gpuctl
        have = _local_tensorflow()
        if not matches(have, version):
            progress(f"warning: the local provider runs with this machine's Python, which has "
                     f"{f'TensorFlow {have}' if have else 'no TensorFlow'}, not {version}: gpuctl installs "
                     "nothing here (install it, or use an ssh or aws cluster)")
        return TfEnv(host=host.label, python=host.python, how="local", tensorflow=have)
    remote = cluster.spec.remote
    env = _choose(host, guards.push_payload(host, facts), remote.workdir, remote.wheelhouse if install else None,
                  remote.python, version, progress)
    facts.python = env.python
    return env


def _preflight(cluster: ClusterRecord, host: Host, facts: NodeFacts, env: TfEnv, progress: Progress,
               recheck: bool) -> TfEnv:
    if host.local:  # no preflight: the local provider is this very Python
        return env
    progress(f"preflight on {host.label}: checking Python, TensorFlow and the GPU")
    report = preflight.preflight(host, guards.push_payload(host, facts), cluster.spec.remote.workdir, recheck,
                                 facts.python_of(host))
    progress(f"preflight on {host.label}: {preflight.summary(report)}")
    return env.model_copy(update={"report": report, "tensorflow": report.get("tensorflow") or env.tensorflow})


def warm(s: Session, cluster: ClusterRecord) -> None:
    """Start each remote host's preflight in the background (`up`), with the Python its runs will
    use: the first `train` then finds the answer kept instead of importing TensorFlow there."""
    python = cluster.spec.remote.python
    for _, host in s.hosts(cluster):
        if not host.local:
            facts = s.facts(host)
            facts.python = python or facts.python
            try:
                preflight.start(host, guards.push_payload(host, facts), cluster.spec.remote.workdir,
                                facts.python_of(host))
            except GpuctlError:
                pass  # only a head start: the first train looks itself


def _choose(host: Host, payload_dir: str, root: str, wheelhouse: str | None, python: str, version: str,
            progress: Progress) -> TfEnv:
    """`wheelhouse` None: look only, install nothing."""
    if python:
        return TfEnv(host=host.label, python=python, how="remote.python")
    where = tf_env.probe(host, payload_dir, root, version)
    ready = where["ready"]
    if ready is not None:
        tf = ready.get("tensorflow") if isinstance(ready.get("tensorflow"), str) else None
        progress(f"TensorFlow {tf} on {host.label}: gpuctl's env {posixpath.dirname(posixpath.dirname(where['python']))} "
                 "(ready)")
        return TfEnv(host=host.label, python=where["python"], how="ready", tensorflow=tf)
    if where["found"]:
        first = where["found"][0]
        progress(f"TensorFlow {first['tensorflow']} on {host.label}: {first['python']} (found there)")
        return TfEnv(host=host.label, python=first["python"], how="found", tensorflow=first["tensorflow"])
    others = ", ".join(f"{o['tensorflow'] or 'no TF'} at {o['python']}" for o in where["others"])
    if wheelhouse is None:
        raise RemoteError(f"no TensorFlow {version} on {host.label} yet{f' ({others})' if others else ''}",
                          "`gpuctl train` (or `gpuctl up`) sets it up there.")
    what = "tensorflow[and-cuda]" if where.get("gpu") else "tensorflow-cpu (no GPU seen)"
    progress(f"setup on {host.label}: no TensorFlow {version} there{f' ({others})' if others else ''}: installing "
             f"{what} {version} into {where['env']} with python {where.get('system_version')}; a few minutes "
             "(`gpuctl logs --setup` shows pip's output)")
    started = time.monotonic()
    pid = tf_env.start_install(host, payload_dir, root, version, wheelhouse)
    result = tf_env.follow(host, where, pid, progress)
    if not result["ok"]:
        if str(result["error"]).startswith(NO_NETWORK):
            raise RemoteError(f"{NO_NETWORK} from {host.label}: {result['error'][len(NO_NETWORK):].strip(' (')[:-1]}",
                              "Give the host the wheels (remote.wheelhouse: a folder of them on it, pip installs "
                              "with --no-index) or a Python with TensorFlow (remote.python), then `gpuctl up` again.")
        raise RemoteError(f"the setup step failed on {host.label}: {result['error']}",
                          "`gpuctl logs --setup` shows pip's output. Check the version exists (--tf), the host "
                          "reaches PyPI (or set remote.wheelhouse), or set remote.python; then `gpuctl up` again.")
    how: Literal["ready", "installed"] = "ready" if result["skipped"] else "installed"
    python = result["python"] if how == "ready" and result["python"] else where["python"]
    return TfEnv(host=host.label, python=python, how=how, tensorflow=result["tensorflow"],
                 seconds=round(time.monotonic() - started, 1))


def _local_tensorflow() -> str | None:
    """The TensorFlow installed for the Python running gpuctl (its metadata: no import, no 3 s)."""
    import importlib.metadata as md

    for dist in ("tensorflow", "tensorflow-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def setup_log(s: Session, cluster: ClusterRecord, version: str | None = None) -> list[tuple[str, str]]:
    """(host, the setup step's log) for each host of the cluster."""
    version = version_of(cluster, version)
    out = []
    for _, host in s.hosts(cluster):
        if host.local:
            raise RemoteError("a local cluster has no setup step", "It runs with the Python that runs gpuctl.")
        payload_dir = guards.push_payload(host, s.facts(host))
        out.append((host.label, tf_env.setup_log(host, payload_dir, cluster.spec.remote.workdir, version)))
    return out

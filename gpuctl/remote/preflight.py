"""Before a run on a remote host: what its Python (ops/setup.py chose it) sees: TensorFlow, the GPU.

The payload keeps its answer on the host per Python and environment (payloads/gpuctl_preflight.py)
so that only the first `train` in an environment pays for importing TensorFlow; nvidia-smi runs
every time. What comes back is the instance's: checked for shape and bounds here, and an answer
that fails the check is asked for once more with the cache ignored."""

from __future__ import annotations

import json
import shlex
from typing import Any, TypeGuard

from gpuctl.errors import RemoteError
from gpuctl.model import untrusted
from gpuctl.remote.host import Host, output_tail
from gpuctl.remote.jobs import start_detached

MAX_LINE = 65536  # one report line; a longer answer is not the payload's
MAX_ITEMS = 64  # GPUs on one host


def preflight(host: Host, payload_dir: str, cache_root: str | None = None, recheck: bool = False,
              python: str | None = None) -> dict[str, Any]:
    """Run the preflight payload with `python` (the host's own by default); its JSON report,
    checked. `cache_root`: the host's work dir, where the answer is kept (None: always the full look)."""
    python = python or host.python
    report, said = _ask(host, python, payload_dir, cache_root, recheck)
    if report is None and cache_root is not None and not recheck:
        report, said = _ask(host, python, payload_dir, cache_root, True)  # a cache gone bad: the full look, kept anew
    if report is None:
        raise RemoteError(
            f"preflight failed on {host.label} with {shlex.quote(python)}: {_printable(said[-300:]) or 'no answer'}",
            "Check that `remote.python` (or python3) runs there.",
        )
    return report


def start(host: Host, payload_dir: str, cache_root: str, python: str | None = None) -> int:
    """The preflight in the background (`up`) with `python` (the host's own by default), so that
    the answer is kept before the first `train` asks (a `train` that comes sooner waits for it on
    the host, and TensorFlow is imported once)."""
    return start_detached(host, [python or host.python, f"{payload_dir}/gpuctl_preflight.py", "--cache", cache_root],
                          "the preflight")


def _ask(host: Host, python: str, payload_dir: str, cache_root: str | None,
         recheck: bool) -> tuple[dict[str, Any] | None, str]:
    """(the checked report or None, what the payload said last)."""
    argv = [python, f"{payload_dir}/gpuctl_preflight.py"]
    if cache_root is not None:
        argv += ["--cache", cache_root] + (["--recheck"] if recheck else [])
    res = host.run(output_tail(argv), check=False, timeout=300)  # only its end comes back: bounded
    said = (res.stderr or res.stdout or "").strip()
    lines = (res.stdout or "").strip().splitlines()
    if not lines or len(lines[-1]) > MAX_LINE:
        return None, said
    try:
        report = json.loads(lines[-1])
    except ValueError:
        return None, said
    why = problem(report)
    return (None, f"its report ignored: {why}") if why else (checked(report), said)


def _printable(text: str) -> str:
    return untrusted.one_line(text, 300)


def _text(value: object, limit: int = 200) -> TypeGuard[str]:
    return isinstance(value, str) and len(value) <= limit and value.isprintable()


def _opt(value: Any, limit: int = 200) -> bool:
    return value is None or _text(value, limit)


def problem(report: Any) -> str | None:
    """Why the report is not believed (None: every field has the shape and size the client uses
    it with). `executable` becomes the job's command: an absolute printable path."""
    if not isinstance(report, dict):
        return f"not an object ({type(report).__name__})"
    exe = report.get("executable")
    if not (_text(exe, 4096) and exe.startswith("/")):
        return "its executable is not an absolute printable path"
    for key in ("python", "tensorflow", "cuda", "cudnn"):
        if not _opt(report.get(key), 64):
            return f"its {key} is not a short printable text"
    if not isinstance(report.get("cached", False), bool):
        return "its cached is not true or false"
    if report.get("error") is not None and not isinstance(report.get("error"), str):
        return "its error is not text"
    gpus, smi = report.get("tf_gpus", []), report.get("nvidia_smi", [])
    if not (isinstance(gpus, list) and len(gpus) <= MAX_ITEMS and all(_text(g) for g in gpus)):
        return f"its tf_gpus is not a list of at most {MAX_ITEMS} short texts"
    if not (isinstance(smi, list) and len(smi) <= MAX_ITEMS and all(
            isinstance(g, dict) and all(_text(g.get(k)) for k in ("name", "memory", "driver")) for g in smi)):
        return f"its nvidia_smi is not a list of at most {MAX_ITEMS} GPUs (name, memory, driver)"
    return None


def checked(report: Any) -> dict[str, Any] | None:
    """The report with only the fields the client uses, if problem() finds none; else None."""
    if problem(report) is not None:
        return None
    gpus, smi, error = report.get("tf_gpus", []), report.get("nvidia_smi", []), report.get("error")
    out = {k: report.get(k) for k in ("python", "executable", "tensorflow", "cuda", "cudnn")}
    out.update(tf_gpus=list(gpus), nvidia_smi=[{k: g[k] for k in ("name", "memory", "driver")} for g in smi],
               cached=bool(report.get("cached", False)),
               error=None if error is None else _printable(error[:300]))
    return out


def verdict(report: dict[str, Any], allow_cpu: bool) -> str | None:
    """Why a run must not start here (None = fine)."""
    if not report.get("tensorflow"):
        return f"TensorFlow is not usable by {report.get('executable')}: {report.get('error') or 'not installed'}"
    if not report.get("tf_gpus") and not allow_cpu:
        seen = ", ".join(g["name"] for g in report.get("nvidia_smi", [])) or "no GPU in nvidia-smi"
        return f"TensorFlow {report['tensorflow']} sees no GPU ({seen})"
    return None


def summary(report: dict[str, Any]) -> str:
    gpus = ", ".join(f"{g['name']} ({g['memory']})" for g in report.get("nvidia_smi", [])) or "no GPU"
    tf = report.get("tensorflow") or "none"
    built = f"CUDA {report.get('cuda') or '-'}, cuDNN {report.get('cudnn') or '-'}"
    when = " (kept from an earlier check of this environment; `train --recheck` checks again)" if report.get(
        "cached") else ""
    return (f"{gpus}; TensorFlow {tf} on Python {report.get('python')} ({built}); "
            f"TensorFlow sees {len(report.get('tf_gpus') or [])} GPU(s){when}")

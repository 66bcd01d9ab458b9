"""Before a run on a remote host: what its Python (ops/setup.py chose it) sees: TensorFlow, the GPU."""

from __future__ import annotations

import json
import shlex
from typing import Any

from gpuctl.errors import RemoteError


def preflight(host: Any, payload_dir: str) -> dict[str, Any]:
    """Run the preflight payload with the host's Python; its JSON report."""
    res = host.run([host.python, f"{payload_dir}/gpuctl_preflight.py"], check=False, timeout=300)
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RemoteError(
            f"preflight failed on {host.label} with {shlex.quote(host.python)}: {(res.stderr or res.stdout).strip()[-300:]}",
            "Check that `remote.python` (or python3) runs there.",
        ) from None


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
    return (f"{gpus}; TensorFlow {tf} on Python {report.get('python')} ({built}); "
            f"TensorFlow sees {len(report.get('tf_gpus') or [])} GPU(s)")

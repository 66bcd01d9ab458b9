"""What the page says after an act: the CLI's sentences in short, or its Error and Hint."""

from __future__ import annotations

from typing import Callable, Union

from gpuctl.errors import GpuctlError
from gpuctl.model.dashboard import ActionResult
from gpuctl.model.results import DownResult, StopResult
from gpuctl.model.untrusted import one_line


CLI = {"stop": "stop", "release": "down"}  # the command each act is


def said(result: Union[StopResult, DownResult]) -> str:
    if isinstance(result, StopResult):
        if result.already_ended is not None:
            return f"Run {result.already_ended.run_id} already ended ({result.already_ended.state}); nothing to stop."
        if not result.stopped:
            return f"No run is running on cluster {result.cluster!r}; nothing to stop."
        runs = ", ".join(r.run_id for r in result.stopped)
        return f"Stopped {runs} on cluster {result.cluster!r}; the cluster stays up (billed until released)."
    if result.already_down:
        return f"Cluster {result.cluster!r} is already down; nothing to do."
    return (f"Cluster {result.cluster!r} is down: released {len(result.released)} resource(s); "
            f"stopped {len(result.stopped_runs)} run(s).")


def acted(name: str, target: str, call: Callable[[], Union[StopResult, DownResult]]) -> ActionResult:
    """Run an act; its result or its error as the page shows it (never a traceback)."""
    try:
        return ActionResult(ok=True, message=said(call()))
    except GpuctlError as exc:
        return ActionResult(ok=False, message=one_line(exc.message), hint=one_line(exc.hint))
    except Exception as exc:  # noqa: BLE001 - a bug: said in one line, as the CLI does
        return ActionResult(ok=False, message=f"internal error: {type(exc).__name__}: {one_line(exc)}",
                            hint=f"Run `gpuctl {CLI[name]} {target}` in a terminal with --debug and report the traceback.")

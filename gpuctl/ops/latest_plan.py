"""The latest `gpuctl plan`'s report, kept in the gpuctl home for `gpuctl dashboard`."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from gpuctl.files import write_private
from gpuctl.model.results import PlanReport
from gpuctl.ops.session import Session

PLAN_FILE = "plans/latest.json"  # under the gpuctl home
MAX_PLAN_BYTES = 4 << 20


def remember_plan(s: Session, report: PlanReport) -> None:
    """Keep the latest plan's report for the dashboard (written whole, then renamed). Best effort:
    a full disk here must not lose the report of probes already paid for (the CLI still prints it)."""
    path = s.home / PLAN_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, report.model_dump_json())
    except OSError:
        pass


def last_plan(s: Session) -> PlanReport | None:
    """The latest plan's report; None if there is none or it is not one (bounded read)."""
    path: Path = s.home / PLAN_FILE
    try:
        with path.open("rb") as f:
            data = f.read(MAX_PLAN_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_PLAN_BYTES:
        return None
    try:
        return PlanReport.model_validate(json.loads(data))
    except (ValueError, ValidationError):
        return None

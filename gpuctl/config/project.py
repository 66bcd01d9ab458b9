"""What a project's gpuctl.toml may set (./gpuctl.toml, and the trained project's own).

A project is data, often someone else's (a clone): it may say how its own job runs and ask for a
stricter guard. Everything that spends money, runs a command on a machine, or decides where keys
and credentials come from is the user's alone (their settings file, GPUCTL_* env, flags). This is
an allow-list: a setting added to the model later is refused from a project until it is listed here.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from pydantic import BaseModel, ConfigDict

from gpuctl.config.settings import parse_duration

# How the project's job runs: taken from a project as it is.
FREE = frozenset({
    "train.entry", "train.mixed_precision", "train.memory_growth", "train.tensorflow",
    "train.checkpoint", "train.keras", "train.tf_log_level", "train.gpu_sample_s",
    "train.requirements", "train.data",
})


def _cap(value: Any) -> float:
    """A limit where 0 means none: 0 is the loosest of all."""
    if value is None:
        return math.inf
    number = float(value)
    return number if number > 0 else math.inf


def _seconds(value: Any) -> Any:
    """A duration as the settings spell it ("30m") or in seconds, as the watchdog's config has it."""
    return parse_duration(value) if isinstance(value, str) else value


def _limit(value: Any) -> float:
    return math.inf if value is None else float(value)


# Guards a project may only tighten: each key's looseness (bigger = looser) of a value as the
# settings hold it, or as the watchdog's config does (idle_s in seconds; None = no limit).
TIGHTEN: dict[str, Callable[[Any], float]] = {
    "guards.max_hours": _limit,
    "guards.budget_usd": _cap,
    "guards.idle": lambda v: _cap(_seconds(v)),
    "guards.stall": lambda v: _cap(_seconds(v)),
    "guards.on_stall": lambda v: 0.0 if v == "fire" else 1.0,
    "guards.down_after_run": lambda v: 0.0 if v else 1.0,
    "train.budget_usd": _cap,
    "train.start_timeout_s": _limit,
}

PROJECT_KEYS = FREE | frozenset(TIGHTEN)
WHERE_DOCUMENTED = 'docs/training.md, "Project settings"'


def at_least_as_strict(key: str, value: Any, than: Any) -> bool:
    """Whether `value` of guard `key` is as strict as `than`, or stricter."""
    looseness = TIGHTEN[key]
    return looseness(value) <= looseness(than)


class Ignored(BaseModel):
    """A key a project's file asked for and did not get: not a project's to set, or looser than
    the value in force below it."""

    model_config = ConfigDict(frozen=True)

    file: str
    key: str
    looser: bool = False


def said(ignored: Sequence[Ignored]) -> str:
    """The one line that tells the user what their project's files asked for in vain."""
    by_file: dict[str, list[str]] = {}
    for i in ignored:
        by_file.setdefault(i.file, []).append(f"{i.key} (looser than yours)" if i.looser else i.key)
    where = "; in ".join(f"{file}: {', '.join(keys)}" for file, keys in by_file.items())
    return (f"Note: ignored in {where}; a project's gpuctl.toml may set how its job runs and ask for "
            f"stricter guards, nothing else ({WHERE_DOCUMENTED}).")

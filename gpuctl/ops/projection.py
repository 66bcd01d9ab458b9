"""`gpuctl plan`'s arithmetic: what a run's epoch reports say about a machine (first epoch, steady
epochs, examples/s, GPU use), what `--epochs N` would cost on it, and the ranking. Pure: no host,
no ledger, so every figure is checked here once.

The reports come from the instance and are untrusted: every figure taken from them is finite and
bounded (a week for a time, the ledger's own bounds for dollars), and the text shown from a run's
log is one line of printable characters.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from gpuctl.model.records import EpochReport
from gpuctl.model.results import PlanRow

MAX_SECONDS = 7 * 86400.0  # longer than any probe's hard cap allows: a figure above it is no reading
STARVED_PERCENT = 60.0  # a GPU busy less than this in its steady epochs waits for its input
LINE_CHARS = 200


def bounded(value: float | None, high: float = MAX_SECONDS) -> float | None:
    """The figure if it is finite and in [0, high], else None."""
    if value is None or isinstance(value, bool):
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) and 0.0 <= f <= high else None


def one_line(text: str | None, limit: int = LINE_CHARS) -> str | None:
    """The last non-empty line of `text`, printable characters only (no terminal control), cut to
    `limit` characters."""
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    if not lines:
        return None
    clean = "".join(c if c.isprintable() else "?" for c in lines[-1].strip())
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


class Measured:
    """What K epochs said: the first epoch (compilation and warm-up included), the steady ones
    after it (the first alone stands for them when there is only one), examples/s and the GPU."""

    def __init__(self, epochs: Sequence[EpochReport]):
        seconds = [bounded(e.seconds) for e in epochs]
        self.epochs = len(epochs)
        self.first_s = seconds[0] if seconds else None
        steady = [(e, s) for e, s in zip(epochs[1:], seconds[1:]) if s is not None] or \
                 ([(epochs[0], self.first_s)] if epochs and self.first_s is not None else [])
        self.steady_epochs = len(epochs) - 1 if len(epochs) > 1 else 0
        self.steady_s = sum(s for _, s in steady) / len(steady) if steady else None
        counted = [(e.examples, s) for e, s in steady if e.examples and s]
        total_s = sum(s for _, s in counted)
        self.examples_per_s = bounded(sum(n for n, _ in counted) / total_s, 1e12) if total_s else None
        utils = [e.gpu_util_percent for e, _ in steady if e.gpu_util_percent is not None]
        self.gpu_util_percent = sum(utils) / len(utils) if utils else None
        memory = [e.gpu_memory_used_mib for e in epochs if e.gpu_memory_used_mib is not None]
        totals = [e.gpu_memory_total_mib for e in epochs if e.gpu_memory_total_mib is not None]
        self.gpu_memory_used_mib = max(memory) if memory else None
        self.gpu_memory_total_mib = max(totals) if totals else None


def project(ready_s: float, first_s: float, steady_s: float, epochs: int, usd_per_hour: float) -> tuple[float, float]:
    """(wall seconds, dollars) of `epochs` epochs: ready + first + (N-1) x steady, at the rate.
    Spot interruptions are not modelled (docs/plan.md)."""
    seconds = ready_s + first_s + max(epochs - 1, 0) * steady_s
    return seconds, seconds * usd_per_hour / 3600.0


def starved(row: PlanRow) -> bool:
    """Whether the GPU waited for its input in the steady epochs (busy under STARVED_PERCENT)."""
    return row.gpu_util_percent is not None and row.gpu_util_percent < STARVED_PERCENT


def rank(rows: Sequence[PlanRow]) -> tuple[PlanRow, ...]:
    """The measured rows by projected dollars (then time), numbered, the fastest marked; the rows
    that measured nothing after them, in the order given."""
    done = sorted((r for r in rows if r.projected_usd is not None),
                  key=lambda r: (r.projected_usd, r.projected_s or 0.0))
    fastest: Optional[PlanRow] = min(done, key=lambda r: r.projected_s or 0.0) if done else None
    out = [r.model_copy(update={"rank": n, "fastest": r is fastest}) for n, r in enumerate(done, 1)]
    return tuple(out) + tuple(r for r in rows if r.projected_usd is None)

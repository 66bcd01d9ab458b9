"""The questions gpuctl asks before it spends or destroys, in words: what the use cases and the
providers state as records (model/results.py LaunchQuestion and DownQuestion, model/specs.py
RunFiles) said here."""

from __future__ import annotations

from gpuctl.model.records import PriceQuote
from gpuctl.model.results import DownQuestion, LaunchQuestion
from gpuctl.model.specs import RunFiles


def launch(q: LaunchQuestion) -> str:
    """"launch a g5.xlarge (spot) for cluster 'default' at $0.4000/h (...), billed until ..."."""
    if q.instance_type is not None:
        what = f"{q.nodes} x {q.instance_type} in one zone" if q.nodes > 1 else f"a {q.instance_type}"
        start = f"launch {what} ({q.market}) for cluster {q.cluster!r}"
    else:
        start = f"start {q.provider} cluster {q.cluster!r}" + (f" ({q.nodes} nodes)" if q.nodes > 1 else "")
    return start + price_words(q.quote, q.max_hours, q.budget_usd)


def price_words(quote: PriceQuote, max_hours: float, budget_usd: float) -> str:
    """The money half of the launch question: the $/h, what the hard cap allows at it, the budget."""
    each = f"{quote.nodes} nodes at ${quote.usd_per_hour / quote.nodes:,.4f}/h each, " if quote.nodes > 1 else ""
    cap = (f"; spot cap ${quote.max_price:,.4f}/h a node ({quote.cap_source})"
           if quote.max_price is not None else "")
    budget = f"; budget ${budget_usd:,.2f} (guards.budget_usd)" if budget_usd > 0 else ""
    # The hard cap's worst case is at the most the launch may bill an hour (spot: its cap), not
    # at the spot price now, which may read $0.0000 and rise.
    worst = quote.worst_usd_per_hour
    at = " at the spot cap" if quote.max_price is not None else ""
    return (f" at ${quote.usd_per_hour:,.4f}/h ({each}{quote.source}{cap}), billed until `gpuctl down` or the "
            f"{max_hours:g} h hard cap ({max_hours:g} h x ${worst:,.4f}/h{at} = ${worst * max_hours:,.2f}){budget}")


def run_files(files: RunFiles) -> str:
    """What becomes of a released cluster's runs' files, by where its provider keeps them."""
    if files.kept == "here":
        return (f"its runs' outputs, checkpoints and logs are kept in {files.where} (`gpuctl pull RUN` "
                "still works; `gpuctl runs rm RUN` deletes one)")
    if files.kept == "on_hosts":
        return "its runs' files stay on the hosts, in remote.workdir (gpuctl leaves them there)"
    if files.kept == "in_store":
        return "its runs' checkpoints, outputs, reports and logs stay in the S3 checkpoint store"
    return "its runs' outputs and checkpoints are on the instance's disk only and go with it (`gpuctl pull RUN` first)"


def down(q: DownQuestion) -> str:
    question = f"release cluster {q.cluster!r} and stop its jobs"
    if q.files is None:
        return question
    question += f" ({run_files(q.files)})"
    if q.unpulled:
        ids = ", ".join(q.unpulled[:5]) + (", ..." if len(q.unpulled) > 5 else "")
        question += (f"; {len(q.unpulled)} run(s) have outputs only on the instance ({ids}): `gpuctl down {q.cluster} "
                     "--pull` brings them back first")
    return question

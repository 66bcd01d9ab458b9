"""The dashboard's looks are incremental (ops/dashboard.Looker): an ended run whose ledger key
did not move is not computed again, and what a look shows is what `status --json` and `cost
--json` say for the same ledger."""

from __future__ import annotations

import json
import time

from bench.cli_latency import fill
from gpuctl.ops import costs
from gpuctl.ops.dashboard import Looker
from gpuctl.ops.session import Session


def _session(isolated) -> Session:
    fill(isolated, 6, 3)
    return Session(isolated)


def test_a_look_rebuilds_only_what_moved(isolated):
    s = _session(isolated)
    looker = Looker()
    first = looker.look(s, time.time())
    assert looker.rebuilt == 6
    looker.look(s, time.time())
    assert looker.rebuilt == 0
    last = s.ledger.epochs("bench-00002")[-1]
    s.ledger.put_epochs([last.model_copy(update={"epoch": 4})])  # a new epoch reaches the ledger
    moved = looker.look(s, time.time())
    assert looker.rebuilt == 1 and moved.details["bench-00002"] != first.details["bench-00002"]
    detail = json.loads(moved.details["bench-00002"])
    assert [e["epoch"] for e in detail["cost"]["epochs"]] == [1, 2, 3, 4]
    run = s.ledger.run("bench-00004")
    s.ledger.put_run(run.model_copy(update={"state": "failed", "exit_code": 3}))  # a record that changed
    looker.look(s, time.time())
    assert looker.rebuilt == 1
    s.close()


def test_a_look_shows_what_status_and_cost_say(isolated):
    s = _session(isolated)
    now = time.time()
    looked = Looker().look(s, now)
    view = json.loads(looked.view)
    status, cost = costs.status(s), costs.cost(s)
    assert [r["status"] for r in view["runs"]] == [json.loads(r.model_dump_json()) for r in status.runs]
    assert [r["spent_usd"] for r in view["runs"]] == [r.spent_usd for r in cost.runs]
    assert view["total_usd"] == cost.total_usd
    assert [c["name"] for c in view["clusters"]] == [c.name for c in status.clusters]
    for rc in cost.runs:
        assert json.loads(looked.details[rc.run_id])["cost"] == json.loads(rc.model_dump_json())
    assert looked.default_run == "bench-00005"  # none runs: the newest
    s.close()


def test_an_ended_run_is_computed_again_after_a_while_all_the_same(isolated):
    """What its key does not cover (resumable, a log tail a host did not give) is never older
    than KEEP_S x 2, and the runs do not all come due in one look."""
    from gpuctl.ops.dashboard import KEEP_S

    s = _session(isolated)
    looker = Looker()
    now = time.time()
    looker.look(s, now)
    looker.look(s, now + KEEP_S * 0.99)
    assert looker.rebuilt == 0
    due = []
    for k in range(1, 11):  # looks every 6 s over the next minute: each run comes due once
        looker.look(s, now + KEEP_S * (1 + k / 10))
        due.append(looker.rebuilt)
    assert sum(due) == 6 and max(due) < 6, due
    s.close()

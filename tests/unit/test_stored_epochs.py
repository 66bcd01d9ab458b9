"""ledger/stored.py: a stored epoch report reads the same through the fast path (no Python
validator per row) as through EpochReport's full validation, for rows as the ledger's writer
writes them and for every row it did not write that way (those take the full path)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpuctl.ledger import stored
from gpuctl.ledger.stored import epoch_from_row
from gpuctl.model.records import EpochReport

BASE: dict[str, Any] = {
    "schema": 1, "run_id": "r1", "epoch": 1, "epochs_planned": 20, "start": 0.0, "end": 10.0, "seconds": 10.0,
    "examples": 50000, "examples_estimated": False, "examples_per_s": 5000.0, "usd_per_hour": 1.0,
    "epoch_cost_usd": 0.1, "cumulative_usd": 0.1, "metrics": {"loss": 0.1}, "gpu_util_percent": None,
    "gpu_memory_used_mib": None, "gpu_memory_total_mib": None, "gpu_samples": None}
BIG = int(1e300)  # the int value of the float 1e300: EpochReport keeps metrics within +-1e300

# Rows as the ledger's writer writes them (an EpochReport's model_dump_json): the fast path.
CANONICAL = [
    {}, {"gpu_util_percent": 50}, {"gpu_util_percent": 50.5, "gpu_samples": 3, "gpu_memory_used_mib": 1234.5},
    {"metrics": {"a": 10**20}}, {"metrics": {"a": BIG}}, {"metrics": {"a b": 1}}, {"metrics": {"a": None}},
    {"metrics": {}}, {"metrics": {"a": -2.5e-7, "b": -0.0, "c": 7}}, {"run_id": "x" * 200},
]
# Anything else: the full path decides, and keeps or refuses as before.
OTHERS = [
    {"gpu_samples": 3.7}, {"gpu_samples": 3.0}, {"gpu_util_percent": "50"}, {"gpu_util_percent": True},
    {"gpu_util_percent": 101}, {"gpu_memory_used_mib": 1e8}, {"metrics": {"b": 1, "a": 2}},
    {"metrics": {"a": 1, "b": True}}, {"metrics": {"a": 10**301}}, {"metrics": {"a": BIG + 1}},
    {"metrics": {"a": 1e300}}, {"metrics": {"a": -1e300}}, {"metrics": {"a  b": 1}}, {"metrics": {" a": 1}},
    {"metrics": {"a\x1b[31m": 1}}, {"metrics": {"a\u00a0b": 1}}, {"metrics": {"a\u2003b": 1}},
    {"metrics": {"a\x85b": 1}}, {"metrics": {"a\u2028b": 1}}, {"metrics": {"x" * 65: 1}}, {"metrics": {"": 1}},
    {"metrics": {"a": "str"}}, {"metrics": {"a": [1]}}, {"metrics": {f"m{i:03d}": i for i in range(70)}},
    {"metrics": "x"}, {"metrics": {"précision": 0.5, "損失": 1e-5, "emoji😀": -2.5e-7}},
    {"run_id": "r\x1b1"}, {"run_id": "x" * 201}, {"run_id": "r\u202e"}, {"start": 1e308}, {"epoch": 0},
    {"examples": -1},
]


def _full(raw: str) -> EpochReport | None:
    try:
        return EpochReport.model_validate_json(raw)
    except ValueError:
        return None


def _fast_takes(raw: str) -> bool:
    epoch_from_row(raw)
    fast = stored._fast[0]
    assert fast is not None, "the fast validator could not be made (pydantic's schema changed shape?)"
    try:
        names = list(fast(raw)[0]["metrics"])
    except ValueError:
        return False
    return names == sorted(names)


@pytest.mark.parametrize("change", CANONICAL + OTHERS, ids=repr)
def test_a_row_reads_as_the_full_validation_reads_it(change):
    raw = json.dumps(dict(BASE, **change))
    got, want = epoch_from_row(raw), _full(raw)
    assert (got is None) == (want is None)
    if want is not None:
        assert got == want and got.model_dump_json() == want.model_dump_json()
        assert got.model_fields_set == want.model_fields_set
        with pytest.raises(ValueError):
            got.epoch = 2  # frozen, as a validated one


@pytest.mark.parametrize("change", CANONICAL, ids=repr)
def test_rows_the_writer_writes_take_the_fast_path(change):
    written = _full(json.dumps(dict(BASE, **change)))
    assert written is not None
    assert _fast_takes(written.model_dump_json(by_alias=True))


@pytest.mark.parametrize("change", OTHERS, ids=repr)
def test_rows_it_does_not_write_take_the_full_path(change):
    assert not _fast_takes(json.dumps(dict(BASE, **change)))


def test_a_run_record_without_its_cluster_id_reads_with_the_columns(tmp_path):
    """A run recorded before runs carried their cluster id (version 1): the column says it."""
    from gpuctl.ledger import Ledger
    from gpuctl.model.records import RunRecord
    from gpuctl.model.specs import LocalSpec

    led = Ledger(tmp_path)
    c = led.add_cluster(LocalSpec(name="lab", usd_per_hour=1.0))
    run = RunRecord(run_id="r-old", cluster="lab", cluster_id=c.id, project="/p", entry="t.py", state="succeeded",
                    started_at=1.0, run_dir="/r")
    led.put_run(run)
    with led.write() as db:
        db.execute("UPDATE runs SET record_json = ?", (run.model_copy(update={"cluster_id": 0}).model_dump_json(),))
    assert [r.cluster_id for r in led.runs()] == [c.id] and led.run("r-old") == run
    led.close()

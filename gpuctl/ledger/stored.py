"""Reading back the epoch reports the ledger's own writer stored, without a Python call per row.

EpochReport (model/records.py) is the instance's line, untrusted: besides its bounds (checked in
pydantic's Rust core) it runs Python validators on every report, which make a bad reading None
(the GPU figures), clean and sort the metrics and clean the run id. A stored row was written by
`Ledger.put_epochs` from an EpochReport that had passed them, so they change nothing in it: run
again on every row of every `cost` (20,000 at 1,000 runs x 20 epochs) they were most of its time.

`epoch_from_row` first validates a row with EpochReport's own schema in which each of those
fields is checked, in Rust, to be already what its validator would leave as it is (a reading
within its bounds or null, metrics of at most 64 clean names with bounded numbers or null, a
clean run id). Anything else (a row an older gpuctl wrote before today's bounds, a row changed by
hand, a newer field's shape) fails that check and goes through EpochReport's full validation,
which keeps what it keeps and refuses what it refuses, as before. So a row reads the same either
way, and a corrupt one is still refused or made harmless.
"""

from __future__ import annotations

import math
from typing import Any, Callable, cast

from pydantic import ValidationError

from gpuctl.model import untrusted
from gpuctl.model.records import MAX_METRICS, EpochReport

# What `untrusted.clean` removes (_SEQUENCES' characters, every C0 control with tab, newline and
# carriage return among them, DEL, C1, the bidi overrides), in Rust regex syntax: a string without
# any is one `clean` returns unchanged.
_CONTROL = r"\x{0}-\x{1f}\x{7f}-\x{9f}\x{202a}-\x{202e}\x{2066}-\x{2069}"
# A metric name `untrusted.one_line(name, 64)` returns unchanged: no control character, words of
# non-space characters joined by one plain space (`\s` is Unicode's White_Space, the characters
# str.split() splits at, less the controls excluded already), nothing before or after.
_NAME = rf"^[^\s{_CONTROL}]+(?: [^\s{_CONTROL}]+)*$"
_LIMIT = int(1e300)  # EpochReport's metrics keep numbers within +-1e300 (untrusted.optional)


def _stored_fields(full: dict[str, Any]) -> dict[str, Any]:
    """EpochReport's fields' core schema, each field its Python validators handle checked as they
    would leave it; KeyError or ValueError when its shape is not the one this was written for."""
    from pydantic_core import core_schema as cs

    if full["type"] != "model" or full["cls"] is not EpochReport or full["schema"]["type"] != "model-fields":
        raise ValueError("EpochReport's core schema has another shape")
    fields = dict(full["schema"]["fields"])

    def reading(high: float, kind: str) -> Any:
        value = (cs.int_schema(strict=True, ge=0, le=int(high)) if kind == "int"
                 else cs.float_schema(strict=True, ge=0, le=high, allow_inf_nan=False))
        return cs.with_default_schema(cs.nullable_schema(value), default=None)

    def field(name: str, schema: Any) -> None:
        if name not in fields:
            raise KeyError(name)
        fields[name] = {**fields[name], "schema": schema}

    # _reading_or_none: a finite number (not a bool, not a string) within [0, high], else None.
    field("gpu_util_percent", reading(100.0, "float"))
    field("gpu_memory_used_mib", reading(1e7, "float"))
    field("gpu_memory_total_mib", reading(1e7, "float"))
    field("gpu_samples", reading(1e7, "int"))
    # _metrics: names as one_line(name, 64) leaves them; an int stays an int within +-1e300 (a
    # larger one is left to the full path: as a float it could round to 1e300), a float within the
    # float just inside 1e300 (an int the int branch refuses must not pass as a float). The names'
    # order (sorted) is checked in Python by epoch_from_row: no schema says it.
    below = math.nextafter(1e300, 0.0)
    number = cs.union_schema([cs.int_schema(strict=True, ge=-_LIMIT, le=_LIMIT),
                              cs.float_schema(strict=True, ge=-below, le=below, allow_inf_nan=False)])
    field("metrics", cs.with_default_schema(cs.dict_schema(
        keys_schema=cs.str_schema(strict=True, max_length=64, pattern=_NAME),
        values_schema=cs.nullable_schema(number), max_length=MAX_METRICS), default={}))
    # untrusted.Short: clean(value, MAX_SHORT) leaves a string of at most MAX_SHORT characters
    # without a control character as it is.
    field("run_id", cs.str_schema(strict=True, max_length=untrusted.MAX_SHORT, pattern=rf"^[^{_CONTROL}]*$"))
    return {**full["schema"], "fields": fields}


Fields = tuple[dict[str, Any], Any, set[str]]  # what a model-fields validator returns: values, extra, fields set


def _stored_validator() -> Callable[[str | bytes], Fields] | None:
    """The fast validator of a row's fields, or None where pydantic's schema is not the shape this
    module knows (every row then takes the full path: slower, the same result). It validates the
    fields alone, not the model: pydantic-core builds a model's schema with the class's own,
    complete validator (its Python validators with it) whatever the schema says."""
    from pydantic_core import SchemaValidator

    EpochReport.model_rebuild()  # defer_build: its schema is made on first use
    full = cast("dict[str, Any]", EpochReport.__pydantic_core_schema__)
    try:
        validator = SchemaValidator(_stored_fields(full), full.get("config"))
    except (KeyError, ValueError, TypeError):
        return None
    return cast("Callable[[str | bytes], Fields]", validator.validate_json)


def _report(values: dict[str, Any], fields_set: set[str]) -> EpochReport:
    """An EpochReport of validated fields, set up as pydantic-core sets up a model it validated
    (its __dict__, the fields set, no extra, no private attributes)."""
    report = _new(EpochReport)
    _set(report, "__dict__", values)
    _set(report, "__pydantic_fields_set__", fields_set)
    _set(report, "__pydantic_extra__", None)
    _set(report, "__pydantic_private__", None)
    return report


_new = object.__new__
_set = object.__setattr__


_fast: list[Callable[[str | bytes], Fields] | None] = []


def epoch_from_row(raw: str | bytes) -> EpochReport | None:
    """A stored report, or None when today's bounds refuse it (as at ingestion)."""
    if not _fast:
        _fast.append(_stored_validator())
    fast = _fast[0]
    if fast is not None:
        try:
            values, _, fields_set = fast(raw)
        except ValidationError:
            pass
        else:
            names = list(values["metrics"])
            if len(names) < 2 or names == sorted(names):
                return _report(values, fields_set)
    try:
        return EpochReport.model_validate_json(raw)
    except ValueError:  # pydantic's ValidationError
        return None

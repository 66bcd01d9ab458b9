"""Untrusted input without a host: the one place that says how much of an instance's word is believed
(gpuctl/model/untrusted.py), the bounded report, the bounded reads, the manifest bomb.

Bad inputs tried: CSI, OSC titles ended by BEL, by ST or cut short, DCS, 8-bit CSI and OSC, C0 and
C1 controls, bidi overrides, carriage-return overwrites; JSON nested 100,000 deep, a 5,000-digit
number, 2 MB of JSON; fields of the wrong type, infinite, out of range, too long; epoch lines over
64 KB, unfinished, split across reads; a zlib bomb."""

from __future__ import annotations

import json
import zlib
from typing import Optional

import pytest
from pydantic import ValidationError

from gpuctl.errors import RemoteError
from gpuctl.model import untrusted
from gpuctl.model.records import EpochReport
from gpuctl.remote.guard_files import WatchdogState
from gpuctl.remote.local import LocalHost
from gpuctl.remote.sync import MANIFEST_MAX, ManifestTooLarge, decode_manifest, inflate, previous_manifest


@pytest.mark.parametrize("raw, shown", [
    ("\x1b]0;pwned\x07title", "title"),
    ("\x1b]2;pwned\x1b\\title", "title"),
    ("\x1b]0;cut short", ""),
    ("\x1b[31mred\x1b[0m \x1b[2J\x1b[10;20H", "red "),
    ("\x1bPdcs string\x1b\\after", "after"),
    ("\x9b31mC1 csi \x9d0;osc\x9cok", "C1 csi ok"),
    ("bell\x07 back\x08 del\x7f nul\x00 c1\x85", "bell back del nul c1"),
    ("\u202eevil\u202c", "evil"),
    ("progress 10%\rprogress 100%\nnext", "progress 100%\nnext"),
    ("tabs\tand\nlines", "tabs\tand\nlines"),
    ("\x1b7saved\x1b8\x1b(B", "saved"),
])
def test_clean_leaves_no_control_sequence(raw, shown):
    assert untrusted.clean(raw) == shown


def test_one_line_is_bounded_and_flat():
    assert untrusted.one_line("a\nb\x1b[1m\tc", 100) == "a b c"
    assert len(untrusted.one_line("x" * 10_000, 50)) == 50


@pytest.mark.parametrize("raw, why", [
    (None, "missing"), (b"[" * 100_000 + b"]" * 100_000, "nested too deep"), (b"9" * 5000, "not JSON"),
    (b"{" + b" " * (2 << 20) + b"}", "over"), (b"\xff\xfe", "not JSON"), (b"{", "not JSON"),
])
def test_loads_refuses_what_it_cannot_bound(raw, why):
    with pytest.raises(untrusted.Untrusted, match=why):
        untrusted.loads(raw)


def test_lenient_keeps_each_field_that_holds_and_names_the_rest():
    found, bad = untrusted.lenient(WatchdogState, {
        "at": "abc", "pid": 42, "stalled": "not a list", "jobs": ["\x1b]0;x\x07run"], "spent_usd": float("inf"),
        "fired": {"reason": "idle", "detail": "d", "action": "a", "at": 1e308}, "logins": {"counted": [{"user": "u", "quiet_s": -1}], "utmp": "/u"},
        "unknown": [1, 2],
    })
    assert found is not None and found.pid == 42 and found.jobs == ["run"] and found.at is None
    assert found.fired is None and found.logins is not None and found.logins.utmp == "/u" and found.logins.counted == []
    assert {b.split(":")[0].split(".")[0] for b in bad} == {"at", "stalled", "spent_usd", "fired", "logins"}
    for shape in ([1, 2, 3], "str", 123, None):
        assert untrusted.lenient(WatchdogState, shape) == (None, [f"not an object ({type(shape).__name__})"])


def test_read_names_the_file_and_what_was_left_out():
    notes: list[str] = []
    assert untrusted.read(WatchdogState, b"[1,2]", "guard/state.json from h", notes) == {}
    assert untrusted.read(WatchdogState, b'{"pid": 7, "at": "x", "gpu_util": null}', "guard/state.json from h",
                          notes) == {"pid": 7, "gpu_util": None}
    assert untrusted.read(WatchdogState, b"", "x", notes) == {}
    assert notes == ["guard/state.json from h ignored: not an object (list)",
                     "guard/state.json from h: 1 field(s) ignored: at: Input should be a valid number, unable to parse "
                     "string as a number"]


def report(**changes) -> dict:
    base = {"schema": 1, "run_id": "r", "epoch": 1, "start": 1.7e9, "end": 1.7e9 + 1, "seconds": 1.0,
            "usd_per_hour": 1.0, "epoch_cost_usd": 0.1, "cumulative_usd": 0.1, "metrics": {"loss": 0.5}}
    return {**base, **changes}


@pytest.mark.parametrize("bad", [
    {"epoch": 100000000000000000000}, {"epoch": 0}, {"epoch": 10_001}, {"start": 1e308}, {"end": -5.0},
    {"seconds": float("inf")}, {"usd_per_hour": float("nan")}, {"cumulative_usd": 1e300}, {"run_id": "r" * 5000},
    {"examples": -1}, {"epochs_planned": 10**30}, {"examples_per_s": float("inf")},
])
def test_an_epoch_report_out_of_bounds_is_refused(bad):
    with pytest.raises(ValidationError):
        EpochReport.model_validate_json(json.dumps(report(**bad)))


def test_an_epoch_reports_metrics_are_kept_clean_and_few():
    metrics = {"\x1b]0;t\x07loss": 1.0, "acc": "high", "x" * 500: 2.0, "": 1.0, "ok": None, **{f"m{i:03}": i for i in range(50)}}
    r = EpochReport.model_validate(report(metrics=metrics))
    assert "loss" in r.metrics and "acc" not in r.metrics and "ok" in r.metrics and "" not in r.metrics
    assert len(EpochReport.model_validate(report(metrics={f"m{i:03}": i for i in range(100)})).metrics) == 64
    assert all(len(k) <= 64 and "\x1b" not in k for k in r.metrics)


class Chunks:
    """A file read `size` bytes at a time, as a host's read_bytes serves it."""

    def __init__(self, data: bytes):
        self.data, self.reads = data, 0

    def __call__(self, offset: int, size: int) -> bytes:
        self.reads += 1
        return self.data[offset:offset + size]


def test_lines_reads_only_whole_lines_from_an_offset_in_chunks():
    data = b"one\ntwo\n" + b"x" * 300 + b"\nthree\nunfinished"
    lines = untrusted.Lines(Chunks(data), 0, max_line=100, chunk=16)
    assert list(lines) == [b"one", b"two", b"three"] and lines.too_long == 1
    assert lines.offset == data.index(b"unfinished")  # the unfinished line waits for next time
    again = untrusted.Lines(Chunks(data + b" now\n"), lines.offset, max_line=100, chunk=16)
    assert list(again) == [b"unfinished now"] and again.offset == len(data) + 5


@pytest.mark.parametrize("chunk", [1, 3, 16, 1 << 20])
def test_nuls_end_lines_and_hold_none_whatever_the_chunks(chunk):
    data = b"\0" * 50 + b"one\0\0two\n\n" + b"\0" * 1000 + b"x" * 300 + b"\0three\n" + b"\0" * 7 + b"unfinished"
    lines = untrusted.Lines(Chunks(data), 0, max_line=100, chunk=chunk)
    assert list(lines) == [b"one", b"two", b"three"] and lines.too_long == 1
    assert lines.offset == data.index(b"unfinished") and lines.scanned == len(data)


def test_a_budget_ends_the_reading_and_the_next_goes_on_from_there():
    data = b"".join(b"line %d\n" % i for i in range(100)) + b"\0" * 5000
    first = untrusted.Lines(Chunks(data), 0, chunk=64, budget=300)
    got = list(first)
    assert first.more and first.scanned == 300 and got == [b"line %d" % i for i in range(len(got))]
    second = untrusted.Lines(Chunks(data), first.offset, chunk=64)
    assert got + list(second) == [b"line %d" % i for i in range(100)] and second.offset == len(data)
    again = untrusted.Lines(Chunks(data), second.offset)
    assert list(again) == [] and again.scanned == 0


@pytest.mark.parametrize("chunk", [1, 4, 1 << 20])
def test_a_reading_begun_inside_a_line_drops_its_rest(chunk):
    data = b"{\"partial\": 1}\nwhole\n"
    assert list(untrusted.Lines(Chunks(data), 3, chunk=chunk, cut=True)) == [b"whole"]
    assert list(untrusted.Lines(Chunks(data), data.index(b"whole") - 1, chunk=chunk, cut=True)) == [b"whole"]


def test_a_host_read_is_bounded_and_reads_ends(tmp_path):
    f = tmp_path / "big"
    f.write_bytes(b"a" * 1000 + b"END")
    host = LocalHost(tmp_path)
    assert host.read_bytes(str(f), 0, 10) == b"a" * 10
    assert host.read_bytes(str(f), -3) == b"END" and host.read_bytes(str(f), -5000) == b"a" * 1000 + b"END"
    assert host.read_bytes(str(f), 5000) == b"" and host.read_bytes(str(tmp_path / "none")) is None


def test_a_zlib_bomb_manifest_stops_at_its_cap_and_says_so():
    z = zlib.compressobj(9)
    bomb = z.compress(b"{" + b" " * (MANIFEST_MAX + 10)) + z.flush()
    assert len(bomb) < MANIFEST_MAX // 100
    with pytest.raises(ManifestTooLarge):
        inflate(bomb, MANIFEST_MAX)
    with pytest.raises(RemoteError, match="expands past 16 MiB") as err:
        previous_manifest(bomb, "h1", "/srv/code/.p.gpuctl-manifest")
    assert "rm -f /srv/code/.p.gpuctl-manifest" in err.value.hint
    assert decode_manifest(zlib.compress(json.dumps({"a": [1, 2]}).encode())) == {"a": (1, 2)}


def test_optional_numbers():
    assert untrusted.optional(3, int, 0, 5) == 3 and untrusted.optional(True, int, 0, 5) is None
    assert untrusted.optional(float("inf"), float, 0, 1e400) is None and untrusted.optional(9, int, 0, 5) is None


def test_models_use_bounded_types_only():
    """Every field of WatchdogState is Optional or has a bounded default: a missing key is never a crash."""
    for name, field in WatchdogState.model_fields.items():
        assert not field.is_required(), name
    assert Optional  # the typing import is what the fields use

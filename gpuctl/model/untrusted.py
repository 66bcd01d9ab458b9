"""What an instance sends back is untrusted input: a compromised host, or a training
script with a bug, writes whatever it likes into the files gpuctl reads. This module is the one
place that says how much of it is believed:

- `clean` / `one_line`: text without terminal control sequences (CSI, OSC titles, DCS, C0 and C1
  controls, bidi overrides), for everything gpuctl renders that came from an instance;
- `loads`: JSON of bounded size and depth, or `Untrusted` (a ValueError) saying why not;
- the bounded field types (`Stamp`, `Seconds`, `Usd`, `Short`, `Text`, ...) that the pydantic
  models of the instance's files are made of, and `lenient`, which keeps each field that holds
  and names each one that does not (a bad field is skipped, never an internal error);
- `Lines`: the complete lines of a growing file from a byte offset on, a chunk at a time, each
  line bounded (epochs.jsonl is read this way: never whole, and only what is new).

Only the standard library and pydantic: it sits under every layer that reads from an instance.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Callable, Iterator, Protocol, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

MAX_READ = 8 << 20  # bytes of an instance's file held at once (a log is read in pieces of this)
MAX_JSON = 1 << 20  # a JSON file of the instance's (state, config, preflight, queue place): larger is not believed
MAX_LINE = 64 << 10  # one line of epochs.jsonl
# Of epochs.jsonl, the bytes one look reads at most: a run keeps at most 10,000 epochs (a few MB of
# reports), so more that is new at once is not the reporter's (a sparse file's hole, a flood), and
# only its last MAX_SCAN bytes are read; the skipped part is named.
MAX_SCAN = 16 << 20
MAX_TEXT = 1000  # a string shown in a table or a summary
MAX_SHORT = 200  # a name, a version, a reason
MAX_ITEMS = 1000  # entries of a list or a mapping in a file of the instance's

# A time on the instance's clock that is believed: from 1970 to 2100 (a host without a clock
# battery or NTP may think it is 1970; only differences of its times are used where that matters).
# Anything else (a 1e308 `start`, an `inf` end) cannot have happened and would break every sum and
# clock built on it.
EARLIEST = 0.0
LATEST = 4102444800.0
MAX_SECONDS = 10 * 366 * 86400.0  # a duration: ten years
MAX_USD = 1e9

# ESC [ ... final byte (CSI); ESC ] ... BEL or ESC \ (OSC: window titles, hyperlinks, clipboard);
# ESC P/X/^/_ ... ESC \ (DCS, SOS, PM, APC); other two-byte escapes; their 8-bit forms; then every
# C0 control but tab and newline, DEL, C1, and the bidi overrides that reorder what is shown.
_SEQUENCES = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]?"
    r"|\x1b\][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x1b[PX^_][^\x1b\x9c]*(?:\x1b\\|\x9c)?"
    r"|\x1b[ -/]*[0-~]?"
    r"|\x9b[0-?]*[ -/]*[@-~]?"
    r"|[\x90\x98\x9d\x9e\x9f][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    r"|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]"
)


class InstanceFile(BaseModel):
    """Base of the models of an instance's files: unknown keys ignored, no inf or nan, frozen."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True, defer_build=True)


class Untrusted(ValueError):
    """An instance's file, line or field that is not believed; the message says why."""


def clean(text: str, limit: int | None = None) -> str:
    """`text` as a terminal may show it: no control sequence, tabs and newlines kept, a line's
    carriage returns resolved as a terminal would (what follows the last one); at most `limit` characters."""
    if limit is not None and len(text) > limit:
        text = text[:limit] + "…"
    if "\r" in text:
        text = "\n".join(line.rsplit("\r", 1)[-1] if "\r" in line.rstrip("\r") else line.rstrip("\r")
                         for line in text.split("\n"))
    return _SEQUENCES.sub("", text)


def one_line(text: Any, limit: int = MAX_TEXT) -> str:
    """Anything as one clean line of at most `limit` characters (error messages, notes)."""
    return " ".join(clean(str(text), limit * 4).split())[:limit]


def loads(raw: bytes | str | None, limit: int = MAX_JSON) -> Any:
    """JSON of at most `limit` bytes; Untrusted when it is missing, larger, nested past Python's
    recursion limit or not JSON."""
    if raw is None:
        raise Untrusted("missing")
    if len(raw) > limit:
        raise Untrusted(f"over {limit:,} bytes")
    try:
        return json.loads(raw)
    except RecursionError:
        raise Untrusted("nested too deep") from None
    except ValueError as exc:  # UnicodeDecodeError, JSONDecodeError, a number of 5000 digits
        raise Untrusted(f"not JSON ({one_line(exc, 80)})") from None


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


def _short_text(limit: int) -> Callable[[str], str]:
    def check(value: str) -> str:
        return clean(value, limit)

    return check


Finite = Annotated[float, AfterValidator(_finite), Field(ge=-1e15, le=1e15)]
Stamp = Annotated[float, Field(ge=EARLIEST, le=LATEST, allow_inf_nan=False)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
Usd = Annotated[float, Field(ge=0, le=MAX_USD, allow_inf_nan=False)]
Percent = Annotated[float, Field(ge=0, le=100 * 64, allow_inf_nan=False)]  # a node's GPUs added up
Count = Annotated[int, Field(ge=0, le=10**15)]
Pid = Annotated[int, Field(ge=1, le=1 << 31)]
ExitCode = Annotated[int, Field(ge=-1024, le=1024)]
# Strings: refused when absurdly long (the file is not gpuctl's), cleaned of control sequences when kept.
Short = Annotated[str, Field(max_length=MAX_SHORT * 4), AfterValidator(_short_text(MAX_SHORT))]
Text = Annotated[str, Field(max_length=MAX_TEXT * 16), AfterValidator(_short_text(MAX_TEXT))]
Names = Annotated[list[Short], Field(max_length=MAX_ITEMS)]

M = TypeVar("M", bound=BaseModel)


def lenient(model: type[M], data: Any, depth: int = 0) -> tuple[M | None, list[str]]:
    """`model` from `data`, field by field: a field that fails its bounds is left out (at its
    default) and named; a nested model that fails is left out whole. (None, why) when `data` is
    not an object or a required field is missing."""
    if not isinstance(data, dict):
        return None, [f"not an object ({type(data).__name__})"]
    kept, bad = {}, []
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in data:
            continue
        value = data[key]
        sub = _nested_model(field.annotation)
        if sub is not None and isinstance(value, dict) and depth < 4:
            inner, why = lenient(sub, value, depth + 1)
            bad += [f"{key}.{w}" if not w.startswith("not an") else f"{key}: {w}" for w in why]
            if inner is not None:
                kept[key] = inner
            continue
        kept[key] = value
    for _ in range(len(kept) + 1):
        try:
            return model.model_validate(kept), bad
        except ValidationError as exc:
            keys = {str(e["loc"][0]) for e in exc.errors() if e["loc"]} & kept.keys()
            if not keys:
                return None, bad + [one_line(e["msg"], 80) for e in exc.errors()[:1]]
            for key in sorted(keys):
                bad.append(f"{key}: {one_line(exc.errors()[0]['msg'], 80)}" if len(keys) == 1 else key)
                del kept[key]
    return None, bad


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The model in `X` or `Optional[X]`, if it is one."""
    args = getattr(annotation, "__args__", None)
    for candidate in (annotation, *(args or ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def parse(model: type[M], raw: bytes | None, limit: int = MAX_JSON) -> tuple[M | None, list[str]]:
    """`lenient(model, loads(raw))`: (None, why) for a file that is no JSON object at all."""
    try:
        data = loads(raw, limit)
    except Untrusted as exc:
        return None, [str(exc)]
    return lenient(model, data)


def dump(model: BaseModel | None) -> dict[str, Any]:
    """The fields a lenient model holds, as plain data (for reports that hold dicts); a field
    absent or left out is no key at all, so `.get(key, default)` reads it as before."""
    return {} if model is None else model.model_dump(mode="json", by_alias=True, exclude_unset=True)


def read(model: type[M], raw: bytes | None, what: str, notes: list[str] | None) -> dict[str, Any]:
    """`dump(parse(model, raw))`, each problem added to `notes` as "WHAT ignored: why" (or the
    fields left out of it); {} for a file that is absent or empty."""
    if not raw:
        return {}
    found, bad = parse(model, raw)
    if bad and notes is not None:
        whole = found is None
        notes.append(f"{what} ignored: {'; '.join(bad[:3])}" if whole else
                     f"{what}: {len(bad)} field(s) ignored: {'; '.join(bad[:3])}")
    return dump(found)


# A line of a report file: what lies between two line ends, where a NUL counts as one (a sparse
# file's hole, a disk block never written) and runs of them are skipped whole, in C.
_LINE = re.compile(rb"[^\n\x00]+")


class Lines:
    """The complete lines of a file that grows, from `offset` on, read `chunk` bytes at a time
    with `read(offset, size)`, at most `budget` bytes in all (None: to the end). A NUL ends a line
    as a newline does and a run of them holds none (a hole of a GB is a moment's scan, never a
    line); a line longer than `max_line` is skipped (and counted in `too_long`); an unfinished
    last line is left for next time. `offset` ends after the last line end read (or past a line
    too long), so the caller can remember it and read only what is new. `cut`: `offset` may be
    inside a line (a reader that skipped ahead): its rest is dropped, not taken for a line."""

    def __init__(self, read: Callable[[int, int], bytes | None], offset: int = 0, max_line: int = MAX_LINE,
                 chunk: int = 1 << 20, budget: int | None = None, cut: bool = False):
        self.read, self.offset, self.max_line, self.chunk = read, offset, max_line, chunk
        self.budget, self.cut = budget, cut
        self.too_long = 0
        self.scanned = 0  # bytes read
        self.more = False  # the budget ended the reading before the file's end

    def __iter__(self) -> Iterator[bytes]:
        pending = b""  # an unfinished line, from self.offset on
        # The line at self.offset is dropped when it ends: it is too long, or it began before the offset.
        too_long, cut = False, self.cut
        at = self.offset
        while True:
            size = self.chunk if self.budget is None else min(self.chunk, self.budget - self.scanned)
            if size <= 0:
                self.more = True
                return
            data = self.read(at, size) or b""
            if not data:
                return
            at += len(data)
            self.scanned += len(data)
            buf, base = (pending + data if pending else data), self.offset
            if (too_long or cut) and buf[:1] in (b"\n", b"\0"):  # the line dropped ended with the last read
                self.too_long += too_long
                too_long = cut = False
            rest = len(buf)  # where an unfinished last line starts
            for m in _LINE.finditer(buf):
                if m.end() == len(buf):
                    rest = m.start()
                    break
                self.offset = base + m.end() + 1
                if too_long or cut or m.end() - m.start() > self.max_line:
                    self.too_long += not cut
                    too_long = cut = False
                    continue
                yield m.group()
            else:
                self.offset = base + len(buf)
            if rest < len(buf):
                self.offset = base + rest
                pending = buf[rest:]
                if rest > 0:  # a line of its own, begun in this read
                    too_long = cut = False
                if len(pending) > self.max_line:
                    self.offset += len(pending)
                    pending, too_long = b"", not cut
            else:
                pending = b""
            if len(data) < size:
                return


class Readable(Protocol):
    """What `reads` needs of a host (remote/host.py's Host has it)."""

    def read_bytes(self, path: str, offset: int = 0, limit: int = MAX_READ) -> bytes | None: ...


def reads(host: Readable, path: str) -> Callable[[int, int], bytes | None]:
    """The `read` of a Lines over one file of a host."""
    return lambda offset, size: host.read_bytes(path, offset, size)


N = TypeVar("N", int, float)  # a number read from the instance


def number(text: str | bytes | None, kind: type[N], low: float = -1e15, high: float = 1e15) -> N | None:
    """A number the instance wrote as text (`ended`, `exitcode`): a `kind` within [low, high], else None."""
    try:
        value = kind(text.decode("ascii") if isinstance(text, bytes) else text) if text else None
    except (ValueError, UnicodeDecodeError):
        return None
    return value if optional(value, kind, low, high) is not None else None


def optional(value: Any, kind: type | tuple[type, ...], low: float, high: float) -> Any:
    """`value` if it is a `kind` (no bool for a number) within [low, high] and finite, else None."""
    if isinstance(value, bool) or not isinstance(value, kind):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if low <= value <= high else None

"""What the CLI shows, the common parts: values, consoles, JSON, fitted tables, the progress sink.

The width rule: money and ids are never cut. A table wider than the console first wraps its
free-text columns (metrics) at spaces, never inside a word; then drops columns, one at a time, in
the order the table declares (`Col.drop`: 1 goes first; 0 is never dropped) and says which it hid;
and when even the kept columns do not fit, it prints one block per row ("stacked"), every value whole.

Status and cost are drawn in cli/render/cost.py, every other command's output in cli/render/commands.py.
These modules are imported only by commands that print, never by `gpuctl --help` (rich costs tens
of milliseconds to import).
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence, TextIO

import click
from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

from gpuctl.model.untrusted import clean

if TYPE_CHECKING:
    from pydantic import BaseModel

GAP = 2  # spaces between two columns
PIPE_WIDTH = 200  # off a terminal (a file, a pipe, a CI log) nobody resizes the page: no need to fold


# --- values ------------------------------------------------------------------------------------


def usd(value: float | None) -> str:
    """Dollars: four decimals below $10 (an epoch costs cents), thousands separators above."""
    if value is None:
        return "-"
    return f"${value:.4f}" if abs(value) < 10 else f"${value:,.2f}"


def duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or abs(seconds) == float("inf"):
        return "-"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{sec:02d}s"
    return f"{seconds:.1f}s" if seconds < 10 else f"{sec}s"


def num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def metrics(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in values.items() if isinstance(v, (int, float)))


def clock(at: float, fmt: str = "%H:%M") -> str:
    return time.strftime(fmt, time.localtime(at))


# --- consoles, JSON ----------------------------------------------------------------------------


def console(stderr: bool = False) -> Console:
    """A console on stdout (or stderr): the terminal's width, or COLUMNS / PIPE_WIDTH off a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    width = None
    if not _isatty(stream):
        columns = os.environ.get("COLUMNS", "")
        width = int(columns) if columns.isdigit() and int(columns) > 0 else PIPE_WIDTH
    return _Console(file=stream, width=width, highlight=False)


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # rich's own answer is SystemExit(1); let the CLI's error mapping treat it as every other
        # closed pipe (quietly, exit 141).
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a real file
        return False


def emit_json(data: BaseModel | Sequence[BaseModel], spooled: Mapping[str, JsonSpool] | None = None) -> None:
    """`--json`: what json.dumps(model_dump(mode="json"), indent=2) writes, byte for byte. A model
    is written by pydantic's own serializer (in Rust: `cost --json` of 1,000 runs in tens of
    milliseconds, not a second through json's pure-Python indenting encoder), a part at a time
    (each item of a tuple of models, such as cost's runs: the whole text is never held, nor a dict
    of the whole report), then spelled as json.dumps spells it. One value apart: an inf or nan,
    which no model lets in (allow_inf_nan=False), would read null, not json.dumps' Infinity that
    no JSON parser takes. `spooled`: for a field (a tuple of models, written item by item), its
    items as a JsonSpool holds them, written in their place (the model holds them without what
    made them large)."""
    from pydantic import BaseModel  # loaded by then: the data is one

    if isinstance(data, BaseModel):
        for part in _json_parts(data, spooled or {}):
            click.echo(part, nl=False)
        click.echo()
        return
    click.echo(json.dumps([d.model_dump(mode="json", by_alias=True) for d in data], indent=2))


def _json_parts(data: BaseModel, spooled: Mapping[str, JsonSpool]) -> Iterator[str]:
    """The model's JSON (indent 2) in parts that add up to it: each field, and each item of a
    field that is a tuple of models of exactly its declared type (a subclass would be written
    with its own fields alone); such a field's items from `spooled` where it has them."""
    import typing

    from pydantic import BaseModel

    fields = type(data).model_fields
    whole = (type(data).model_computed_fields or type(data).__pydantic_decorators__.model_serializers
             or any(f.alias or f.serialization_alias or f.exclude for f in fields.values()))
    if whole:  # written otherwise than field by field: at once
        yield _dumped(data)
        return
    yield "{\n"
    for n, (name, info) in enumerate(fields.items()):
        value, args = getattr(data, name), typing.get_args(info.annotation)
        tail = ",\n" if n < len(fields) - 1 else "\n"
        if (isinstance(value, tuple) and value and len(args) == 2 and args[1] is Ellipsis
                and isinstance(args[0], type) and issubclass(args[0], BaseModel)
                and all(type(item) is args[0] for item in value)):
            yield f"  {json.dumps(name)}: [\n"
            texts = spooled[name].texts(len(value)) if name in spooled else (_dumped(item) for item in value)
            for m, text in enumerate(texts):
                yield "    " + text.replace("\n", "\n    ") + (",\n" if m < len(value) - 1 else "\n")
            yield "  ]" + tail
        else:
            yield _dumped(data, name)[2:-2] + tail  # `{\n  "name": ...\n}`: its middle
    yield "}"


class JsonSpool:
    """Models' JSON texts (as emit_json writes each item of a tuple field) kept in an unnamed
    temporary file, in order, as they are made, and read back one at a time when written: the
    models are gone by then (`cost --json`: 8 MB of text at 1,000 runs x 20 epochs, and 500
    bytes of objects for each of its figures while it was a model). Use it in a `with`."""

    def __init__(self) -> None:
        import tempfile

        self._file = tempfile.TemporaryFile("w+", encoding="utf-8", newline="")
        self._sizes: list[int] = []

    def add(self, item: BaseModel) -> None:
        text = _dumped(item)
        self._file.write(text)
        self._sizes.append(len(text))

    def texts(self, expected: int) -> Iterator[str]:
        """The texts in the order they were added; `expected` of them (a spool that does not hold
        the field's items is an error here, not a wrong report)."""
        if expected != len(self._sizes):
            raise RuntimeError(f"spooled {len(self._sizes)} items where the report has {expected}")
        self._file.seek(0)
        for size in self._sizes:
            yield self._file.read(size)

    def __enter__(self) -> JsonSpool:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def _dumped(data: BaseModel, field: str | None = None) -> str:
    """json.dumps(data.model_dump(mode="json", include=...), indent=2), by pydantic's serializer."""
    include = None if field is None else {field}
    try:
        return as_json_dumps(data.model_dump_json(indent=2, by_alias=True, include=include))
    except (ValueError, UnicodeError):  # pydantic's serialization errors (a lone surrogate): the long way
        return json.dumps(data.model_dump(mode="json", by_alias=True, include=include), indent=2)


# Floats that pydantic writes otherwise than repr() (json.dumps' spelling): under 1e-4 in decimals
# (0.00001, repr: 1e-05) and exponents of one digit (2.5e-7, repr: 2.5e-07); the regular ones match
# too and come out as they were. Only where a number stands: after `": "` or alone on its line, up
# to an optional comma and the line's end; a JSON string holds no raw newline, so none matches
# inside one.
_ODD_FLOAT = re.compile(r"(?m)(: |^ +)(-?(?:0\.0000\d+|\d+(?:\.\d+)?e[-+]\d+))(,?)$")
_NOT_ASCII = re.compile("[^\x00-\x7e]")  # json.dumps (ensure_ascii) escapes DEL too


def as_json_dumps(text: str) -> str:
    """pydantic's indented JSON, spelled as json.dumps(..., indent=2) spells the same values:
    every character past ASCII as \\uXXXX (surrogate pairs past the BMP), floats as repr()."""
    if "0.0000" in text or "e-" in text or "e+" in text:
        text = _ODD_FLOAT.sub(lambda m: m[1] + repr(float(m[2])) + m[3], text)
    if not text.isascii() or "\x7f" in text:
        text = _NOT_ASCII.sub(_escape, text)
    return text


def _escape(m: re.Match[str]) -> str:
    n = ord(m[0])
    if n < 0x10000:
        return f"\\u{n:04x}"
    n -= 0x10000
    return f"\\u{0xD800 | (n >> 10):04x}\\u{0xDC00 | (n & 0x3FF):04x}"


# --- tables ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Col:
    header: str
    right: bool = False  # numbers and money
    drop: int = 0  # order of dropping when too wide: 1 first, 2 next...; 0 = never (ids, key money)
    wrap: bool = False  # free text: may wrap at spaces, never inside a word


def fit(cols: Sequence[Col], rows: Sequence[Sequence[str]], width: int) -> tuple[list[int], list[int]] | None:
    """(indexes of the columns kept, each column's width) that fit `width`; None: stack the rows."""
    natural = [max([width_of(c.header)] + [width_of(r[i]) for r in rows]) for i, c in enumerate(cols)]
    # A wrapping column can shrink to its longest word: nothing is ever folded inside a word.
    least = [max([1] + [width_of(w) for text in (c.header, *(r[i] for r in rows)) for w in text.split()])
             if c.wrap else natural[i] for i, c in enumerate(cols)]
    keep = list(range(len(cols)))
    drops = [i for _, i in sorted((c.drop, i) for i, c in enumerate(cols) if c.drop)]
    while keep:
        gaps = GAP * (len(keep) - 1)
        if sum(natural[i] for i in keep) + gaps <= width:
            return keep, natural
        spare = width - gaps - sum(least[i] for i in keep)
        if spare >= 0:
            widths = list(natural)
            # Spare room goes first to the columns that need the least to be whole, so a short
            # one (a source) is not wrapped for the benefit of a long one (a value).
            for i in sorted((i for i in keep if cols[i].wrap), key=lambda i: natural[i] - least[i]):
                widths[i] = least[i] + min(spare, natural[i] - least[i])
                spare -= widths[i] - least[i]
            return keep, widths
        if not drops:
            return None
        keep.remove(drops.pop(0))
    return None


def table(out: Console, cols: Sequence[Col], rows: Sequence[Sequence[str]], note: bool = True) -> list[str]:
    """Print rows under cols, fitted to out.width by the width rule (module docstring); the headers
    of the columns it hid, also named in a note below the table unless `note` is False."""
    rows = [[cell(c) for c in row] for row in rows]
    plan = fit(cols, rows, out.width)
    if plan is None:
        stacked(out, cols, rows)
        return []
    keep, widths = plan
    header = _lines([cols[i].header for i in keep], [cols[i] for i in keep], [widths[i] for i in keep])
    body = [line for row in rows
            for line in _lines([row[i] for i in keep], [cols[i] for i in keep], [widths[i] for i in keep])]
    # One Text for the whole table, never read as markup (a `[x]` in a value prints as is); the
    # lines already fit, so rich is not asked to wrap them (and rich's Table is ~1 ms a row).
    text = Text("\n".join(header + body))
    text.stylize("bold", 0, sum(len(line) + 1 for line in header) - 1)
    out.print(text, soft_wrap=True)
    hidden = [cols[i].header for i in range(len(cols)) if i not in keep]
    if hidden and note:
        hidden_note(out, hidden)
    return hidden


def _lines(cells: Sequence[str], cols: Sequence[Col], widths: Sequence[int]) -> list[str]:
    """One table row as lines: cells padded to their widths, wrapping cells wrapped at spaces."""
    import textwrap

    parts = [textwrap.wrap(cell, width, break_long_words=False, break_on_hyphens=False) or [""]
             if col.wrap and not _whole(cell, width) else [cell] for cell, col, width in zip(cells, cols, widths)]
    lines = []
    for n in range(max(len(p) for p in parts)):
        padded = []
        for part, col, width in zip(parts, cols, widths):
            cell = part[n] if n < len(part) else ""
            fill = " " * (width - width_of(cell))
            padded.append(fill + cell if col.right else cell + fill)
        lines.append((" " * GAP).join(padded).rstrip())
    return lines


def _whole(cell: str, width: int) -> bool:
    """Whether textwrap.wrap(cell, width) would give [cell] back: a printable ASCII line that fits
    and neither starts nor ends with a space (most metrics cells; textwrap costs ~10 us a cell)."""
    return (0 < len(cell) <= width and cell.isascii() and cell.isprintable() and cell[0] != " "
            and cell[-1] != " ")


def hidden_note(out: Console, headers: Sequence[str], what: str = "") -> None:
    out.print(Text(f"(hidden{what} to fit {out.width} columns: {', '.join(headers)})", style="dim"))


def stacked(out: Console, cols: Sequence[Col], rows: Sequence[Sequence[str]]) -> None:
    """One block per row: the first cell (an id) alone in bold, then `header  value` lines whose
    values wrap at spaces under themselves; a word longer than the line stays whole."""
    import textwrap

    label = max((cell_len(c.header) for c in cols[1:]), default=0)
    indent = 2 + label + 2
    for n, row in enumerate(rows):
        if n:
            out.print()
        out.print(Text(row[0], style="bold"), soft_wrap=True)
        for c, cell in zip(cols[1:], row[1:]):
            lines = textwrap.wrap(cell, max(1, out.width - indent), break_long_words=False,
                                  break_on_hyphens=False) or [""]
            out.print(Text(f"  {c.header:<{label}}  {lines[0]}"), soft_wrap=True)
            for more in lines[1:]:
                out.print(Text(" " * indent + more), soft_wrap=True)


def say(out: Console, *parts: str | tuple[str, str]) -> None:
    """A line of prose: plain strings and (text, style) pairs, word-wrapped, never read as markup
    and without control sequences (a part may hold what an instance wrote)."""
    out.print(Text.assemble(*(clean(p) if isinstance(p, str) else (clean(p[0]), p[1]) for p in parts)))


def notes(lines: Sequence[str]) -> None:
    """What a command found on an instance and did not believe, on stderr: one line each."""
    for line in lines:
        click.echo(cell(f"note: {line}"), err=True)


def cell(text: str) -> str:
    """A table cell: one line, no control sequences."""
    if text.isprintable():  # no control character, tab or newline: nothing to take out (most cells)
        return text
    return clean(text).replace("\n", " ").replace("\t", " ")


def width_of(text: str) -> int:
    """Terminal cells `text` takes: its length where it is printable ASCII (a table's cells nearly
    all are; rich's cell_len costs more than the rest of a row at 5,000 runs), else rich's count."""
    return len(text) if text.isascii() and text.isprintable() else cell_len(text)


def text_block(out: Console, text: str) -> None:
    """Lines of an instance's text (a log's tail) as they are, less control sequences; no markup, no wrapping."""
    out.out(clean(text), highlight=False)


# --- the progress sink --------------------------------------------------------------------------


class Progress:
    """The `progress` callable handed to use cases; a context manager that settles the last line.

    On a terminal the newest line is written in place, and the next line replaces it when both
    name the same step (the same text before the first ": ", e.g. "code: 120 files" then "code:
    300 files, done"), or when it was a live status (ending in "..." or "…"); otherwise it is kept
    and the next goes below. A live status left at the end is erased; other lines stay. Off a
    terminal every line goes to stderr, flushed (the record of a launch survives a kill), but live
    statuses at most one per LIVE_EVERY_S, so a poll loop does not flood a CI log.
    """

    LIVE_EVERY_S = 5.0
    ERASE = "\r\x1b[K"  # to the start of the line, clear it

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _isatty(self.stream) if tty is None else tty
        self.current: str | None = None  # the line on screen, not yet ended by a newline
        self.live_printed_at = float("-inf")
        self.broken = False

    def __call__(self, line: str) -> None:
        if self.broken:
            return
        line = " ".join(clean(line).splitlines()).rstrip()  # a progress line may quote the instance
        try:
            self._terminal(line) if self.tty else self._plain(line)
        except OSError:
            # stderr went away (a closed pipe): progress is commentary, never a reason to
            # abandon a launch or a release half done.
            self.broken = True

    def _terminal(self, line: str) -> None:
        if self.current is not None:
            replace = _is_live(self.current) or _step(line) is not None and _step(line) == _step(self.current)
            self.stream.write(self.ERASE if replace else "\n")
        text = "  " + line
        if cell_len(text) >= _terminal_width(self.stream):
            # A line that wraps cannot be erased in place: keep it whole, as a finished line.
            self.stream.write(text + "\n")
            self.current = None
        else:
            self.stream.write(text)
            self.current = line
        self.stream.flush()

    def _plain(self, line: str) -> None:
        now = time.monotonic()
        if _is_live(line):
            if now - self.live_printed_at < self.LIVE_EVERY_S:
                return
            self.live_printed_at = now
        else:
            self.live_printed_at = float("-inf")  # the next step's first live line shows
        self.stream.write(f"  {line}\n")
        self.stream.flush()

    def close(self) -> None:
        """End the line on screen: erase a live status, keep a finished line."""
        if self.current is not None and not self.broken:
            try:
                self.stream.write(self.ERASE if _is_live(self.current) else "\n")
                self.stream.flush()
            except OSError:
                pass
        self.current = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_live(line: str) -> bool:
    return line.endswith(("...", "…"))


def _step(line: str) -> str | None:
    head, sep, _ = line.partition(": ")
    return head if sep else None


def _terminal_width(stream: Any) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 80

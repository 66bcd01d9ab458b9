"""TensorFlow releases gpuctl knows exist, so that `up --tf 9.99` is refused before anything is
launched (the host's pip gives its own answer later, at the setup step).

Made 2026-12-01 from `pip index versions tensorflow` against PyPI (Python 3.11): 2.12 to 2.21.
Older releases exist for older Pythons but were not seen then, so they are not listed. Only the
minor version is checked: a patch release, or the next minor one, may come out after the list,
and the host's pip answers for those.
"""

from __future__ import annotations

from gpuctl.errors import ConfigError

LIST_DATE = "2026-12-01"
RELEASES = (
    "2.12.0", "2.12.1", "2.13.0", "2.13.1", "2.14.0", "2.14.1", "2.15.0", "2.15.1",
    "2.16.1", "2.16.2", "2.17.0", "2.17.1", "2.18.0", "2.18.1", "2.19.0", "2.19.1",
    "2.20.0", "2.21.0",
)


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def check(version: str) -> None:
    """Refuse a version that is not a TensorFlow release (the dated list, or the one after it)."""
    minors = sorted({_minor(v) for v in RELEASES})
    newest = minors[-1]
    # A patch release, or the next minor one, may have come out since the list was made: pip says.
    if _minor(version) in minors or _minor(version) == (newest[0], newest[1] + 1):
        return
    raise ConfigError(
        f"--tf {version}: no such TensorFlow release (gpuctl's list of {LIST_DATE}: "
        f"{minors[0][0]}.{minors[0][1]} to {newest[0]}.{newest[1]})",
        f"Give a release such as {newest[0]}.{newest[1]} (setting `train.tensorflow`); "
        f"`pip index versions tensorflow` lists them all.")

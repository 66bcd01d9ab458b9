"""TensorFlow's C++ start-up lines, kept out of `logs` and `train --wait` (the log file on the
instance keeps every line; `gpuctl logs --raw` shows them).

TF_CPP_MIN_LOG_LEVEL (setting `train.tf_log_level`) silences most of them at the source, but
lines printed before absl's logging starts ignore it (the oneDNN and CUDA-stub notices, measured
on TF 2.21) and the failed cuInit of a machine without a GPU is an error line that preflight
already reports in words. The script's own output and real errors pass untouched.
"""

from __future__ import annotations

import re

# glog's prefix as TensorFlow's C++ writes it: severity letter, MMDD, a time (before absl's init:
# 00:00:<epoch seconds>), thread id, and a C++ source file:line]. A Python script's own absl
# logging names a .py file and always shows.
GLOG = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:[\d.]+\s+\d+ [^\]\s]+\.(?:cc|cpp|h):\d+\] ")
ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
NO_GPU = "failed call to cuInit"
MAX_PARTIAL = 1 << 20  # characters of an unfinished line held back (TensorFlow's lines are short)


def noise(line: str, level: int) -> bool:
    """Whether `line` is start-up chatter that TF_CPP_MIN_LOG_LEVEL=`level` means to hide."""
    if level <= 0:
        return False
    if line.startswith(ABSL_NOTICE):
        return True
    m = GLOG.match(line)
    if not m:
        return False
    return "IWEF".index(m.group(1)) < level or NO_GPU in line


class LineFilter:
    """Filters a stream that arrives in chunks: a partial last line waits for the rest."""

    def __init__(self, level: int):
        self.level = level
        self._partial = ""

    def feed(self, chunk: str) -> str:
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_PARTIAL:  # a log with no newline for megabytes: passed on as it comes
            lines.append(self._partial)
            self._partial = ""
            return "".join(line + "\n" for line in lines[:-1] if not noise(line, self.level)) + lines[-1]
        return "".join(line + "\n" for line in lines if not noise(line, self.level))

    def flush(self) -> str:
        rest, self._partial = self._partial, ""
        return "" if not rest or noise(rest, self.level) else rest

"""A project's packages (its requirements.txt) on the instance: a venv layered on the TensorFlow
environment its runs use, made once per file and marked ready. Run with that environment's own
Python (whose packages it layers on); stdlib only, Python 3.8+.

    PYTHON gpuctl_packages.py probe   --env DIR --requirements FILE    one JSON line: refused? ready?
    PYTHON gpuctl_packages.py install --env DIR --requirements FILE [--wheelhouse DIR]

DIR (ROOT/_envs/req-HASH-KEY: the file's hash and the Python's, named by ops/packages.py) is a
venv made without pip whose site-packages holds a .pth that adds the parent's site directories
after its own: its packages come first, the parent's TensorFlow is seen and never installed again
(`venv --system-site-packages` would layer on the base interpreter, not on a parent venv). Next to
it, as gpuctl_setup.py has them: DIR.log (all pip said; lines "gpuctl-setup: " are progress),
DIR.lock (one install at a time per file and Python), DIR.result.PID.json. The venv counts as
ready only with its marker, written last: an install killed half-way is made again.

TensorFlow is never replaced: a line naming a TensorFlow distribution must admit the version
installed (it is then left to the parent), and one naming keras or tf-keras the version of it
TensorFlow has here; anything else is refused, naming the line, before anything is made. pip gets
a constraints file pinning them, so a package that depends on another TensorFlow fails instead.
"""

import argparse
import fcntl
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from gpuctl_setup import Log, outcome, read_json  # beside this file on the instance

MARKER = ".gpuctl-ready"
LAYER_PTH = "_gpuctl_layer.pth"
MAX_FILE = 256 << 10
# One TensorFlow per environment, whatever its distribution is called.
TF_NAMES = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel", "tensorflow-macos",
            "tensorflow-aarch64", "intel-tensorflow", "tf-nightly", "tf-nightly-cpu", "tf-nightly-gpu")
# The Keras that TensorFlow was installed with (keras 3, or tf-keras of its minor): kept as it is.
KERAS_NAMES = ("keras", "tf-keras")
# Options a requirements file may carry (where pip looks, which builds it takes); any other (-r,
# -c, -e, --trusted-host, ...) is refused: each would reach past this one file, or loosen a check.
OPTIONS = ("-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--pre", "--prefer-binary",
           "--only-binary", "--no-binary")
NAME = re.compile(r"^([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(\[[^\]]*\])?\s*(.*)$")
SPEC = re.compile(r"^\s*(~=|===|==|!=|<=|>=|<|>)\s*(\S+?)\s*$")
VERSION = re.compile(r"^v?(\d+(?:\.\d+)*)(?:[-_.]?(a|b|rc|c|alpha|beta|pre|preview)[-_.]?(\d*))?"
                     r"(?:[-_.]?(?:post|rev|r)[-_.]?(\d*))?(?:[-_.]?dev[-_.]?(\d*))?(?:\+[a-z0-9.]+)?$")
PRE = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def logical_lines(text: str) -> List[Tuple[int, str]]:
    """(first line number, text) of each requirement or option, as pip reads the file: comments
    (# at the start or after a space) and blank lines dropped, a trailing backslash joined."""
    out: List[Tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = (pending + line).strip(), ""
        if line:
            out.append((start, line))
    if pending.strip():
        out.append((start, pending.strip()))
    return out


def _key(text: str) -> Optional[Tuple[Any, ...]]:
    """A PEP 440 version as a sortable key (release with trailing zeros dropped, pre, post, dev)."""
    m = VERSION.match(text.strip().lower())
    if not m:
        return None
    release = [int(p) for p in m.group(1).split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    pre = (0, PRE[m.group(2)], int(m.group(3) or 0)) if m.group(2) else ((-1, 0, 0) if m.group(5) is not None
                                                                        and m.group(4) is None else (1, 0, 0))
    post = int(m.group(4)) if m.group(4) is not None else -1
    dev = (0, int(m.group(5) or 0)) if m.group(5) is not None else (1, 0)
    return tuple(release), pre, post, dev


def _prefix(installed: str, prefix: str) -> Optional[bool]:
    have, want = VERSION.match(installed.lower()), VERSION.match(prefix.lower())
    if not have or not want or want.group(0) != want.group(1):  # 2.21.* only, no 2.21rc1.*
        return None
    parts = [int(p) for p in want.group(1).split(".")]
    mine = [int(p) for p in have.group(1).split(".")]
    mine += [0] * (len(parts) - len(mine))
    return mine[:len(parts)] == parts


def admits(op: str, version: str, installed: str) -> Optional[bool]:
    """Whether `installed` satisfies `op version` (None: a version this cannot read)."""
    if op == "===":
        return installed == version
    if op in ("==", "!=") and version.endswith(".*"):
        inside = _prefix(installed, version[:-2])
        return None if inside is None else inside == (op == "==")
    have, want = _key(installed), _key(version)
    if have is None or want is None:
        return None
    if op == "~=":
        release = version.split("+")[0].split(".")
        inside = _prefix(installed, ".".join(re.sub(r"\D.*$", "", p) for p in release[:-1])) if len(release) > 1 else None
        return None if inside is None else inside and have >= want
    return {"==": have == want, "!=": have != want, "<=": have <= want, ">=": have >= want,
            "<": have < want, ">": have > want}[op]


def installed_versions() -> Dict[str, str]:
    """The TensorFlow and Keras distributions this Python has: {normalized name: version}."""
    out = {}
    for name in TF_NAMES + KERAS_NAMES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def check(text: str, have: Dict[str, str]) -> Tuple[Optional[str], List[str], List[str]]:
    """(why the file is refused or None, lines pip gets, notes on the lines kept from pip)."""
    tf = next((have[n] for n in TF_NAMES if n in have), None)
    passed: List[str] = []
    notes: List[str] = []
    for number, line in logical_lines(text):
        shown = " ".join(line.split())
        said = "line %d (%s)" % (number, shown if len(shown) <= 80 else shown[:77] + "...")
        if line.startswith("-"):
            option = re.split(r"[\s=]", line, maxsplit=1)[0]
            if option not in OPTIONS:
                return "%s: the option %s is not taken here: list the packages in this one file" % (said, option), [], []
            passed.append(line)
            continue
        m = NAME.match(line)
        rest = m.group(3).split(";")[0] if m else ""
        rest = re.sub(r"\s--\S+.*$", "", " " + rest).strip()  # per-line options (--hash=...)
        if not m or re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", line) or rest.startswith(("/", ".")) or \
                (rest and not rest.startswith(("@", "(")) and not SPEC.match(rest.split(",")[0])):
            return "%s: not a package this can read: give a name, name==version or name @ URL" % said, [], []
        name = norm(m.group(1))
        specs = [] if rest.startswith("@") else [s for s in rest.strip("()").split(",") if s.strip()]
        if name in TF_NAMES or (name in KERAS_NAMES and name in have):
            what, version = ("TensorFlow", tf) if name in TF_NAMES else (m.group(1), have[name])
            if version is None:
                return ("%s: this Python has no TensorFlow to keep: TensorFlow comes from the cluster "
                        "(train.tensorflow, up --tf), not from requirements" % said), [], []
            if rest.startswith("@"):
                return "%s: %s comes from the cluster here (%s), not from a URL" % (said, what, version), [], []
            for spec in specs:
                parsed = SPEC.match(spec)
                fits = admits(parsed.group(1), parsed.group(2), version) if parsed else None
                if fits is None:
                    return "%s: cannot read the version in %r" % (said, spec.strip()), [], []
                if not fits:
                    return ("%s asks for another %s than the cluster's %s %s, which a project never replaces"
                            % (said, what, what, version)), [], []
            if name in TF_NAMES:  # pip would install this distribution too (tensorflow next to tensorflow-cpu)
                notes.append("%s: the cluster's TensorFlow %s is kept" % (said, tf))
                continue
        passed.append(line)
    return None, passed, notes


def constraints(have: Dict[str, str]) -> List[str]:
    """What pip may not change: each TensorFlow distribution at its version here (one not here:
    none at all), and the Keras TensorFlow has."""
    pins = ["%s==%s" % (n, have[n]) if n in have else "%s<0" % n for n in TF_NAMES]
    return pins + ["%s==%s" % (n, have[n]) for n in KERAS_NAMES if n in have]


def read_text(path: str) -> str:
    with open(path, "rb") as fh:
        data = fh.read(MAX_FILE + 1)
    if len(data) > MAX_FILE:
        raise SystemExit("the requirements file is over %d KiB" % (MAX_FILE >> 10))
    return data.decode("utf-8", "replace")


def identity() -> Dict[str, str]:
    """What a layered venv was made against: this Python (a new one at that path needs a new venv)."""
    return {"parent": sys.executable, "python": "%d.%d.%d" % sys.version_info[:3]}


def ready(env: str) -> Optional[Dict[str, Any]]:
    marker = read_json(os.path.join(env, MARKER))
    mine = identity()
    if isinstance(marker, dict) and all(marker.get(k) == v for k, v in mine.items()) and \
            os.access(os.path.join(env, "bin", "python"), os.X_OK):
        return marker
    return None


def probe(args: argparse.Namespace) -> None:
    refused, passed, notes = check(read_text(args.requirements), installed_versions())
    log = args.env + ".log"
    print(json.dumps({"refused": refused, "ready": ready(args.env) is not None, "notes": notes,
                      "count": sum(1 for p in passed if not p.startswith("-")),
                      "log_size": os.path.getsize(log) if os.path.exists(log) else 0}))


def site_dirs() -> List[str]:
    """This Python's site directories, as its own sys.path orders them."""
    return [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]


def make(args: argparse.Namespace, log: Log, passed: List[str], have: Dict[str, str]) -> None:
    env = args.env
    shutil.rmtree(env, ignore_errors=True)  # a half-made one from a killed install
    if log.run([sys.executable, "-m", "venv", "--without-pip", env]) != 0:
        raise SystemExit("cannot make a venv with %s" % sys.executable)
    python = os.path.join(env, "bin", "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True).stdout.strip()
    if not purelib:
        raise SystemExit("the new venv's Python does not run")
    # addsitedir, not plain paths: the parent's own .pth files (editable installs) count too.
    with open(os.path.join(purelib, LAYER_PTH), "w") as fh:
        fh.write("import site; " + "; ".join("site.addsitedir(%r)" % d for d in site_dirs()) + "\n")
    if log.run([python, "-m", "pip", "--version"]) != 0 and log.run([python, "-m", "ensurepip", "--default-pip"]) != 0:
        raise SystemExit("no pip for %s (install python3-pip there)" % sys.executable)
    reqs, cons = os.path.join(env, "requirements.txt"), os.path.join(env, "constraints.txt")
    with open(reqs, "w") as fh:
        fh.write("\n".join(passed) + "\n")
    with open(cons, "w") as fh:
        fh.write("\n".join(constraints(have)) + "\n")
    argv = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
            "--retries", "2", "--timeout", "60", "-r", reqs, "-c", cons]
    if args.wheelhouse:
        argv += ["--no-index", "--find-links", os.path.expanduser(args.wheelhouse)]
    log.step("pip install of %d requirement(s)%s" % (
        sum(1 for p in passed if not p.startswith("-")),
        " from the wheelhouse %s" % args.wheelhouse if args.wheelhouse else ""))
    start = log.fh.tell()
    if log.run(argv) != 0:
        raise SystemExit("pip: %s" % last_line(log.fh.name, start))


def last_line(path: str, start: int) -> str:
    """pip's last word since `start`: its last ERROR line, else its last line."""
    with open(path, "rb") as fh:
        fh.seek(max(start, os.path.getsize(path) - 65536))
        lines = [ln.strip() for ln in fh.read().decode("utf-8", "replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    return (errors or lines or ["(nothing)"])[-1][:300]


def install(args: argparse.Namespace) -> None:
    env, started = args.env, time.time()
    os.makedirs(os.path.dirname(env), exist_ok=True)
    result = {"ok": False, "pid": os.getpid(), "started": started, "python": os.path.join(env, "bin", "python")}
    with open(env + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another install of this file for this Python: wait, then find it made
        log = Log(env + ".log")
        with outcome(log, result, env, "%s.result.%d.json" % (env, os.getpid()), started):
            if ready(env):
                log.step("ready already (made by an earlier install)")
                result.update(ok=True, skipped=True)
                return
            have = installed_versions()
            refused, passed, _ = check(read_text(args.requirements), have)
            if refused:
                raise SystemExit(refused)
            log.step("installing the project's packages into %s, on %s" % (env, sys.executable))
            make(args, log, passed, have)
            marker = dict(identity(), seconds=round(time.time() - started, 1), made_at=time.time(),
                          wheelhouse=bool(args.wheelhouse))
            with open(os.path.join(env, MARKER), "w") as fh:
                json.dump(marker, fh)
            result.update(ok=True)
            log.step("ready: the project's packages in %.0f s" % (time.time() - started))
    sys.exit(0 if result["ok"] else 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["probe", "install"])
    parser.add_argument("--env", required=True)
    parser.add_argument("--requirements", required=True)
    parser.add_argument("--wheelhouse", default="")
    args = parser.parse_args()
    if not re.match(r"^req-[0-9a-f]{16}-[0-9a-f]{8}$", os.path.basename(args.env)):  # it is removed and made
        parser.error("--env must be a gpuctl packages env (req-HASH-KEY)")
    {"probe": probe, "install": install}[args.command](args)


if __name__ == "__main__":
    main()

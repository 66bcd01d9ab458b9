"""The launcher imports TensorFlow only when the script does (payloads/gpuctl_imports.py): the
post-import hook's mechanics on small packages made here, and a plain script through the real
launcher (the Keras side, with real TensorFlow, is in integration/test_payload_tf.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from gpuctl.ops.guards import PAYLOAD_DIR
from gpuctl.payloads import gpuctl_imports

# "fk_keras" imports "fk_tf" half-way through its own import, as standalone Keras 3 imports
# TensorFlow; "fk_tf" reaches for fk_keras.Model only once both are whole.
PACKAGES = {
    "fk_tf/__init__.py": "import fk_tf_sub\nVERSION = '1'\n",
    "fk_tf_sub.py": "X = 1\n",
    "fk_keras/__init__.py": "BEFORE = 1\nimport fk_tf\nclass Model(object):\n    pass\n",
    "fk_broken/__init__.py": "import fk_tf\nraise ImportError('broken on purpose')\n",
}


@pytest.fixture
def packages(tmp_path, monkeypatch):
    for rel, text in PACKAGES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("fk_")]:
        del sys.modules[name]


def _watch(seen):
    def on_import():
        keras = sys.modules.get("fk_keras")
        seen.append({"tf": "fk_tf" in sys.modules and hasattr(sys.modules["fk_tf"], "VERSION"),
                     "keras_whole": keras is not None and hasattr(keras, "Model")})
    return gpuctl_imports.ImportWatch(("fk_tf", "fk_keras", "fk_broken"), on_import)


def test_the_hook_runs_once_the_outermost_import_is_whole(packages):
    seen: list[dict] = []
    watch = _watch(seen).install()
    try:
        assert seen == []  # nothing watched is imported yet
        import fk_keras  # noqa: F401  (imports fk_tf half-way)

        # Once, after fk_keras (not after the fk_tf inside it, when fk_keras had no Model yet).
        assert seen == [{"tf": True, "keras_whole": True}]
        import fk_tf  # noqa: F401  (already imported: no finder, no second call)

        assert len(seen) == 1
        # The wrapper stepped aside: the modules carry their real loaders.
        for name in ("fk_tf", "fk_keras"):
            module = sys.modules[name]
            assert type(module.__loader__).__name__ == "SourceFileLoader"
            assert module.__spec__.loader is module.__loader__
    finally:
        watch.uninstall()


def test_a_failed_import_calls_nothing_and_the_next_one_does(packages):
    seen: list[dict] = []
    watch = _watch(seen).install()
    try:
        with pytest.raises(ImportError, match="broken on purpose"):
            import fk_broken  # noqa: F401
        assert seen == []  # the outer import failed: not a moment to touch anything
        assert watch.depth() == 0
        import fk_keras  # noqa: F401

        assert seen == [{"tf": True, "keras_whole": True}]
    finally:
        watch.uninstall()


def test_installed_after_the_import_it_runs_at_once(packages):
    import fk_tf  # noqa: F401

    seen: list[dict] = []
    watch = _watch(seen).install()
    watch.uninstall()
    assert seen == [{"tf": True, "keras_whole": False}]
    assert watch not in sys.meta_path


def test_other_modules_pass_through(packages):
    watch = _watch([]).install()
    try:
        assert watch.find_spec("json") is None  # not watched: Python's own finders answer
        assert watch.find_spec("fk_not_there") is None
        import fk_tf_sub  # noqa: F401
    finally:
        watch.uninstall()


def test_a_plain_script_runs_without_tensorflow(tmp_path):
    """The launcher imports TensorFlow only when the script does (it did for
    every script: this test failed with 'tensorflow' in sys.modules)."""
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import json, sys
        print(json.dumps({"modules": sorted(m for m in ("tensorflow", "keras", "tf_keras", "numpy")
                                            if m in sys.modules), "argv": sys.argv}))
    """))
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "r", "entry": "train.py", "usd_per_hour": 1.0,
                                                   "report_path": str(tmp_path / "epochs.jsonl")}))
    proc = subprocess.run([sys.executable, str(PAYLOAD_DIR / "gpuctl_run.py"), str(tmp_path / "run.json"), "--x", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"modules": [], "argv": ["train.py", "--x", "1"]}
    assert "TensorFlow" not in proc.stderr  # no word about a TF the script never asked for


def test_crash_in_the_script_is_its_exit_status(tmp_path):
    """(It ran with real TensorFlow imported first; what it tests is the launcher's.)"""
    (tmp_path / "train.py").write_text("raise RuntimeError('boom in user code')\n")
    report = tmp_path / "epochs.jsonl"
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "r", "entry": "train.py", "usd_per_hour": 1.0,
                                                   "report_path": str(report)}))
    proc = subprocess.run([sys.executable, str(PAYLOAD_DIR / "gpuctl_run.py"), str(tmp_path / "run.json")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "boom in user code" in proc.stderr
    assert not report.exists() or report.read_text() == ""


def test_a_stop_asked_before_the_launcher_could_hear_it_ends_the_run_before_the_script(tmp_path):
    """`stop` writes STOP_FILE, then sends SIGTERM; a job just starting lost that SIGTERM in its
    script's fork, and `stop` waited its whole grace (10 s) before SIGKILL."""
    from gpuctl.payloads.gpuctl_protocol import STOP_FILE, STOPPED_EXIT

    (tmp_path / "train.py").write_text("open('ran', 'w').write('yes')\n")
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "r", "entry": "train.py", "usd_per_hour": 1.0,
                                                   "report_path": str(tmp_path / "epochs.jsonl")}))
    (tmp_path / STOP_FILE).write_text("")
    proc = subprocess.run([sys.executable, str(PAYLOAD_DIR / "gpuctl_run.py"), str(tmp_path / "run.json")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == STOPPED_EXIT and "stopped before the script started" in proc.stderr
    assert not (tmp_path / "ran").exists()


def test_the_loader_wrapper_answers_for_the_real_loader_and_copies_safely(packages):
    import copy

    watch = _watch([]).install()
    try:
        spec = watch.find_spec("fk_tf")
        assert spec.loader.is_package("fk_tf") and "VERSION" in spec.loader.get_source("fk_tf")
        copy.copy(spec.loader)  # made without __init__: must not recurse looking for `loader`
    finally:
        watch.uninstall()


def test_the_queue_runs_the_launcher_in_its_own_process_as_python_would(tmp_path):
    """The queue ran the launcher through a second interpreter (exec: ~40 ms of every run); it now
    runs it in its own process. What the script sees and what its run's owner sees stay: the
    queue's pid (which holds the slots) is the script's, the script is __main__ with its own argv
    and directory first on sys.path, its exit status is the run's, and a crash shows only the
    script's frames."""
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import atexit, json, os, sys
        print(json.dumps({"pid": os.getpid(), "name": __name__, "argv": sys.argv, "path0": sys.path[0]}))
        atexit.register(lambda: print("at exit", sys.argv[0], flush=True))
        if sys.argv[1:] == ["crash"]:
            def inner():
                raise RuntimeError("boom in user code")
            inner()
        sys.exit(int(sys.argv[1]))
    """))
    queue = tmp_path / "queue"
    (tmp_path / "run.json").write_text(json.dumps({
        "run_id": "r", "entry": "train.py", "usd_per_hour": 1.0, "report_path": str(tmp_path / "epochs.jsonl"),
        "queue": {"dir": str(queue), "slots": 1, "want": 1, "gpus": 0, "now": False, "node_usd_per_hour": 1.0}}))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(PAYLOAD_DIR / "gpuctl_queue.py"), str(tmp_path / "run.json"),
                               str(PAYLOAD_DIR / "gpuctl_run.py"), *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)

    proc = run("7")
    assert proc.returncode == 7, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-2])
    held = json.loads((tmp_path / "queue.json").read_text())
    assert held["state"] == "running" and held["pid"] == seen["pid"]
    assert seen == {"pid": seen["pid"], "name": "__main__", "argv": ["train.py", "7"], "path0": str(tmp_path)}
    # As under `python train.py`: nothing puts the launcher's argv back before the exit handlers
    # run (runpy did, when the queue ran the launcher through it).
    assert proc.stdout.strip().splitlines()[-1] == "at exit train.py"
    crash = run("crash")
    assert crash.returncode == 1
    frames = [line for line in crash.stderr.splitlines() if line.strip().startswith("File ")]
    assert frames and all("train.py" in line for line in frames), crash.stderr
    assert "boom in user code" in crash.stderr

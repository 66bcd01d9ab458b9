"""The payload's pure parts, and its promise to run on the instance's Python 3.8 with only the
stdlib and TensorFlow (the TF-dependent parts are tested with real TF in integration/)."""

import ast
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from gpuctl.model.records import EpochReport
from gpuctl.payloads import gpuctl_gpu, gpuctl_report, gpuctl_run
from gpuctl.payloads.gpuctl_protocol import RunConfig

PAYLOADS = sorted((Path(gpuctl_report.__file__).parent).glob("gpuctl_*.py"))


@pytest.mark.parametrize("path", PAYLOADS, ids=lambda p: p.name)
def test_payload_parses_as_python_38_and_imports_only_stdlib_and_tf(path):
    tree = ast.parse(path.read_text(), feature_version=(3, 8))
    # The payloads travel together: one may import another beside it.
    allowed = set(sys.stdlib_module_names) | {"tensorflow", "keras", "tf_keras"} | {p.stem for p in PAYLOADS}
    if path.name == "gpuctl_tensorboard.py":
        allowed |= {"tensorboard"}  # TensorFlow's own (its pip package requires it)
    if path.name == "gpuctl_notebook.py":
        allowed |= {"jupyterlab"}  # `gpuctl notebook` installs it with that Python's pip first, if missing
    if path.name == "gpuctl_store.py":
        # The checkpoint store uses boto3 where the instance's Python has it, imported inside a
        # function only (test_store.py checks the module imports without it); else the AWS CLI.
        allowed |= {"boto3", "botocore"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "payloads are copied alone: no relative imports"
            names = [node.module]
        else:
            continue
        for name in names:
            assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
    # Subscripted builtins (list[str]) and `X | Y` in annotations fail on 3.8 at runtime.
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            assert node.value.id not in {"list", "dict", "tuple", "set", "type"}, f"{path.name}: {ast.unparse(node)}"


def test_report_writer_costs_seconds_times_rate(tmp_path):
    w = gpuctl_report.ReportWriter(str(tmp_path / "e.jsonl"), "r1", usd_per_hour=3.6)
    a = w.write(100.0, 112.5, 500, False, 3, {"loss": np.float32(0.25), "bad": float("nan"), "s": "x"})
    b = w.write(112.5, 120.0, 500, False, 3, {})
    assert a["epoch_cost_usd"] == pytest.approx(12.5 * 3.6 / 3600)
    assert b["cumulative_usd"] == pytest.approx(20.0 * 3.6 / 3600)
    assert a["examples_per_s"] == pytest.approx(40.0)
    assert a["metrics"] == {"bad": None, "loss": 0.25, "s": None}
    lines = (tmp_path / "e.jsonl").read_text().splitlines()
    reports = [EpochReport.model_validate_json(line) for line in lines]
    assert [r.epoch for r in reports] == [1, 2]
    assert json.loads(lines[0])["schema"] == 1


def test_budget_stops_before_the_epoch_that_would_cross_it(tmp_path):
    w = gpuctl_report.ReportWriter(str(tmp_path / "e.jsonl"), "r", usd_per_hour=3600.0, budget_usd=2.5)
    r = w.write(0.0, 1.0, None, True, 5, {})  # $1
    assert not w.budget_exhausted(r["epoch_cost_usd"])  # 1 + 1 <= 2.5
    r = w.write(1.0, 2.0, None, True, 5, {})  # $2
    assert w.budget_exhausted(r["epoch_cost_usd"])  # 2 + 1 > 2.5
    free = gpuctl_report.ReportWriter(str(tmp_path / "f.jsonl"), "r", usd_per_hour=3600.0)
    free.write(0.0, 100.0, None, True, 5, {})
    assert not free.budget_exhausted(100.0)


def test_count_examples_for_arrays():
    x = np.zeros((1000, 4))
    assert gpuctl_report.count_examples(x, None) == (1000, 32)
    assert gpuctl_report.count_examples(x, 64, validation_split=0.2) == (800, 64)
    assert gpuctl_report.count_examples([x, x], 10, steps_per_epoch=5) == (50, 10)
    assert gpuctl_report.count_examples({"a": x}, 8) == (1000, 8)
    assert gpuctl_report.count_examples(None, None) == (None, None)


@pytest.mark.parametrize(
    "setting, ccs, expected",
    [
        ("auto", [], False),  # CPU only: never
        ("on", [], False),
        ("auto", [(8, 6)], True),  # A10G (g5)
        ("auto", [(7, 0)], True),  # V100 (p3)
        ("auto", [(6, 1)], False),  # GTX 1060
        ("auto", [(8, 0), (6, 1)], False),  # mixed fleet: the slowest decides
        ("auto", [None], False),
        ("on", [(6, 1)], True),
        ("off", [(9, 0)], False),
    ],
)
def test_mixed_precision_decision(setting, ccs, expected):
    assert gpuctl_gpu.want_mixed_precision(setting, ccs) is expected


def test_utmp_layouts_match_glibc_on_both_architectures():
    """384 bytes where glibc keeps the session and time 32-bit (x86), 400 on aarch64; a file whose
    size only the other layout divides is read with that one."""
    from gpuctl.payloads import gpuctl_logins as gl

    assert (gl.UTMP_COMPAT32.size, gl.UTMP_LP64.size) == (384, 400)
    assert gl.utmp_record(400 * 3) is gl.UTMP_LP64  # 1200 bytes: only 400-byte records fit
    assert gl.utmp_record(384 * 5) is gl.UTMP_COMPAT32  # 1920 bytes: only 384-byte records fit


def test_a_read_only_store_restores_but_never_pushes(tmp_path, monkeypatch):
    """A multi-node run's other nodes restore the chief's checkpoint; only the chief uploads."""
    store = gpuctl_run.RunStore()
    pushed = []
    store.configure(RunConfig.from_dict({"store": {"target": {"bucket": "b"}, "key_prefix": "p/", "read_only": True}}),
                    str(tmp_path))
    monkeypatch.setattr(store, "store", type("S", (), {"push": staticmethod(lambda *a, **k: pushed.append(a))}))
    store.save("epoch 1")
    assert pushed == []
    store.read_only = False
    store.save("epoch 1")
    assert len(pushed) == 1

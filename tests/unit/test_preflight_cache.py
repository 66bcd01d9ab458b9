"""Preflight once per environment: the payload keeps its answer on the host per
Python executable and environment, looks again when either changes or with --recheck, and a
cache that is not its own (garbage, huge, another shape) means a fresh look, never a crash. The
client checks what comes back and asks once more, cache ignored, when it cannot use it.

The full look imports TensorFlow (seconds): the payload's `check` is replaced by a recorder here,
and the real one is run by the ssh tests (integration/test_ssh.py)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from gpuctl.errors import RemoteError
from gpuctl.payloads import gpuctl_preflight as pf
from gpuctl.remote import preflight
from gpuctl.remote.local import LocalHost

GPU = [{"name": "NVIDIA A10G", "memory": "23028 MiB", "driver": "550.1"}]


@pytest.fixture
def payload(tmp_path, monkeypatch, capsys):
    """run(*args) -> (report, full looks so far); the env's root (sys.prefix) is tmp_path/env."""
    env = tmp_path / "env"
    env.mkdir()
    monkeypatch.setattr(pf.sys, "prefix", str(env))
    looks = []
    gpus = {"now": list(GPU)}
    monkeypatch.setattr(pf, "nvidia_smi", lambda: [dict(g) for g in gpus["now"]])

    def check(found):
        looks.append(found)
        return {"python": "3.11.7", "executable": sys.executable, "nvidia_smi": found, "tensorflow": "2.21.0",
                "tf_gpus": ["/physical_device:GPU:0"], "cuda": "12.5", "cudnn": "9", "error": None}

    monkeypatch.setattr(pf, "check", check)

    def run(*args):
        pf.main(["--cache", str(tmp_path / "work"), *args])
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1]), len(looks)

    run.env, run.gpus, run.looks = env, gpus, looks
    run.cache = Path(pf.cache_path(str(tmp_path / "work")))
    return run


def test_a_second_preflight_in_the_same_environment_does_not_look_again(payload):
    first, looks = payload()
    assert looks == 1 and first["cached"] is False and first["tensorflow"] == "2.21.0"
    assert payload.cache.parent.name == "_preflight" and payload.cache.is_file()
    second, looks = payload()
    assert looks == 1 and second["cached"] is True
    assert {k: v for k, v in second.items() if k != "cached"} == {k: v for k, v in first.items() if k != "cached"}


def test_recheck_looks_again(payload):
    payload()
    report, looks = payload("--recheck")
    assert looks == 2 and report["cached"] is False
    assert payload()[1] == 2  # and keeps that answer


def test_a_changed_environment_looks_again(payload, monkeypatch):
    payload()
    (payload.env / ".gpuctl-ready").write_text('{"tensorflow": "2.21.0"}')  # the setup step (re)made the env
    assert payload()[1] == 2
    assert payload()[1] == 2
    payload.gpus["now"] = [dict(GPU[0], driver="560.9")]  # a new driver: TF's view may differ
    report, looks = payload()
    assert looks == 3 and report["nvidia_smi"][0]["driver"] == "560.9"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert payload()[1] == 4
    monkeypatch.setattr(pf.sys, "executable", "/opt/other/bin/python")  # another Python: its own file
    assert payload()[1] == 5 and len(list(payload.cache.parent.glob("*.json"))) == 2


def test_the_gpu_list_is_fresh_on_every_train(payload):
    payload()
    payload.gpus["now"] = []  # the GPU fell off the bus: the fingerprint differs, TF is asked again
    report, looks = payload()
    assert looks == 2 and report["nvidia_smi"] == []


@pytest.mark.parametrize("content", [
    b"not json", b"\xff\xfe\x00garbage", b"[1, 2]", b'{"version": 1}', b"{" * 100000,
    b'{"version": 99, "fingerprint": null, "report": {}}',
], ids=["text", "binary", "list", "no-fingerprint", "huge", "other-version"])
def test_a_cache_that_is_not_ours_means_a_fresh_look(payload, content):
    payload()
    payload.cache.write_bytes(content)
    report, looks = payload()
    assert looks == 2 and report["cached"] is False
    assert json.loads(payload.cache.read_text())["version"] == pf.CACHE_VERSION  # written anew


def test_a_cache_with_the_right_key_but_a_bad_report_means_a_fresh_look(payload):
    payload()
    data = json.loads(payload.cache.read_text())
    for bad in ("a string", {"tensorflow": None}, {"tensorflow": 2.21}):
        data["report"] = bad
        payload.cache.write_text(json.dumps(data))
        assert payload()[0]["cached"] is False
    assert payload()[0]["cached"] is True


def test_a_failed_look_is_not_kept(payload, monkeypatch):
    monkeypatch.setattr(pf, "check", lambda found: {"python": "3.11", "executable": sys.executable,
                                                    "nvidia_smi": found, "tensorflow": None, "tf_gpus": [],
                                                    "cuda": None, "cudnn": None, "error": "ImportError: no"})
    payload()
    assert not payload.cache.exists()  # the user fixes the install; the next train looks again


def test_no_cache_dir_no_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pf, "nvidia_smi", lambda: [])
    monkeypatch.setattr(pf, "check", lambda found: {"tensorflow": "2.21.0", "error": None})
    pf.main([])
    assert json.loads(capsys.readouterr().out)["cached"] is False


# --- the client's side: what comes back is the instance's -------------------------------------

GOOD = {"python": "3.11.7", "executable": "/usr/bin/python3", "nvidia_smi": GPU, "tensorflow": "2.21.0",
        "tf_gpus": ["/physical_device:GPU:0"], "cuda": "12.5", "cudnn": "9", "error": None, "cached": True}


@pytest.mark.parametrize("change", [
    {"executable": "python3"}, {"executable": "/x\x1b[2J"}, {"executable": 7}, {"tensorflow": "2" * 65},
    {"tensorflow": "2.21\x1b]0;pwned\x07"}, {"tf_gpus": "GPU:0"}, {"tf_gpus": ["g"] * 65}, {"tf_gpus": [None]},
    {"nvidia_smi": [{"name": "A10G"}]}, {"nvidia_smi": [["A10G"]]}, {"cached": "yes"}, {"error": 3},
], ids=repr)
def test_the_client_refuses_a_report_of_another_shape(change):
    assert preflight.checked(dict(GOOD, **change)) is None


def test_the_client_keeps_only_what_it_knows_and_cleans_the_error():
    report = preflight.checked(dict(GOOD, extra="x" * 10000, error="bad\x1b[31m thing"))
    assert "extra" not in report and report["error"] == "bad thing"  # untrusted.one_line: the sequence goes whole
    assert preflight.checked(GOOD) == GOOD


def _stub_payload(tmp_path: Path, first: str) -> LocalHost:
    """A host (this machine) whose preflight answers `first` unless asked with --recheck."""
    payload = tmp_path / "payload"
    payload.mkdir()
    (payload / "gpuctl_preflight.py").write_text(textwrap.dedent(f"""
        import json, sys
        if "--recheck" in sys.argv:
            print(json.dumps({GOOD!r}))
        else:
            sys.stdout.write({first!r})
    """))
    host = LocalHost(tmp_path / "root")
    host.python = sys.executable
    return host


@pytest.mark.parametrize("first", ["{not json\n", "x" * 70000 + "\n", '{"executable": "rel"}\n', ""],
                         ids=["torn", "huge", "bad-shape", "nothing"])
def test_a_bad_answer_is_asked_for_again_without_the_cache(tmp_path, first):
    host = _stub_payload(tmp_path, first)
    assert preflight.preflight(host, str(tmp_path / "payload"), "/work") == GOOD


def test_a_bad_answer_with_recheck_is_an_error_with_a_hint(tmp_path):
    host = _stub_payload(tmp_path, "")
    (tmp_path / "payload" / "gpuctl_preflight.py").write_text("import sys\nsys.stderr.write('boom\\x1b[2J')\n")
    with pytest.raises(RemoteError, match="preflight failed on .*: boom$") as err:  # the escape stripped whole
        preflight.preflight(host, str(tmp_path / "payload"), "/work")
    assert "remote.python" in err.value.hint


def test_two_preflights_of_one_python_import_tensorflow_once(payload, monkeypatch):
    """`up` starts one in the background; a `train` that comes before it is done waits for its
    answer (an flock beside the cache) instead of importing TensorFlow beside it."""
    import threading
    import time

    inner = pf.check

    def slow(found):
        time.sleep(0.3)
        return inner(found)

    monkeypatch.setattr(pf, "check", slow)
    root = str(payload.cache.parent.parent)
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(pf.answer(["--cache", root]))) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(10)
    assert len(payload.looks) == 1
    assert sorted(a["cached"] for a in answers) == [False, True]
    assert all(a["tensorflow"] == "2.21.0" for a in answers)

"""The fetch payload (gpuctl/payloads/gpuctl_fetch.py, gpuctl_datacache.py) against a real HTTP
server answering as S3 answers a presigned GET (tests/objects_http.py): the key checks, the
cache (a second fetch gets nothing, a changed object comes again), a cut fetch that goes on
where it stopped, 503 SlowDown waited out, an object changed mid-fetch named, hostile keys
refused and nothing written outside the data directory, a disk too small refused."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

from gpuctl.payloads import gpuctl_datacache as cache
from gpuctl.payloads import gpuctl_fetch as fetch
from tests.objects_http import ObjectServer, Served
from tests.waits import wait_for

PAYLOAD = Path(fetch.__file__)


@pytest.fixture
def server():
    srv = ObjectServer().start()
    yield srv
    srv.close()


def plan_for(srv: ObjectServer, root: Path, keys: list[str] | None = None, **extra) -> dict:
    keys = sorted(srv.objects) if keys is None else keys
    objects = [[k, len(srv.objects[k].body), srv.objects[k].etag, srv.url(k)] for k in keys]
    return {"version": cache.PLAN_VERSION, "dir": str(root / "data" / "s3-b-12345678"), "source": "s3://b/p/", "threads": 4,
            "objects": objects, "backoff_s": 0.01, **extra}


def write_plan(tmp_path: Path, plan: dict) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return str(path)


def run(plan: dict) -> dict:
    return fetch.fetch(cache.load_plan_data(plan))


# --- the key checks ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rel, why", [
    ("", "an empty name"),
    ("/etc/passwd", "an absolute path"),
    ("../escape", "a '.' or '..' part"),
    ("a/../../b", "a '.' or '..' part"),
    ("./a", "a '.' or '..' part"),
    ("a//b", "an empty part"),
    ("a/b/", "an empty part"),
    ("bad\x1b[31mname", "a control character"),
    ("new\nline", "a control character"),
    ("c1\x9bthing", "a control character"),
    ("win\\path", "a backslash"),
    ("x" * 256, "a name over 255 bytes"),
    ("é" * 128, "a name over 255 bytes"),  # 256 bytes in UTF-8
    ("/".join(["d" * 200] * 21), "a path over 4000 bytes"),
])
def test_unsafe_paths_are_refused_with_why(rel, why):
    assert (cache.check_rel(rel) or "").startswith(why)


@pytest.mark.parametrize("rel", ["a", "train/0001.png", "x" * 255, "名前/データ.bin", ".hidden", "a b/c-d_e.txt"])
def test_plain_paths_pass(rel):
    assert cache.check_rel(rel) is None


def test_a_path_another_object_needs_as_a_directory_is_refused():
    assert cache.conflicts(["a", "a/b", "c/d", "c/e"]) == {"a/b": "its directory a is another object"}


# --- fetch and cache --------------------------------------------------------------------------------

def test_fetch_then_warm_fetch_gets_nothing_and_a_changed_object_comes_again(server, tmp_path):
    server.objects = {"a.txt": Served(b"alpha" * 1000), "sub/b.bin": Served(os.urandom(300_000)),
                      "sub/deep/c": Served(b"")}
    first = run(plan_for(server, tmp_path))
    root = tmp_path / "data" / "s3-b-12345678"
    assert first["ok"] and (first["fetched"], first["cached"]) == (3, 0), first
    assert (root / "sub" / "b.bin").read_bytes() == server.objects["sub/b.bin"].body
    assert (root / "sub" / "deep" / "c").read_bytes() == b""
    assert sorted(os.listdir(root.parent)) == [".s3-b-12345678.gpuctl-fetch", "s3-b-12345678"]

    server.requests.clear()
    second = run(plan_for(server, tmp_path))
    assert (second["fetched"], second["cached"], server.requests) == (0, 3, []), second

    server.objects["a.txt"] = Served(b"changed")
    third = run(plan_for(server, tmp_path))
    assert (third["fetched"], third["cached"]) == (1, 2), third
    assert [k for k, _ in server.requests] == ["a.txt"]
    assert (root / "a.txt").read_bytes() == b"changed"


def test_objects_no_longer_listed_are_removed_and_a_run_s_hard_link_keeps_its_copy(server, tmp_path):
    server.objects = {"keep": Served(b"k"), "gone/x": Served(b"x")}
    run(plan_for(server, tmp_path))
    root = tmp_path / "data" / "s3-b-12345678"
    os.link(root / "gone" / "x", tmp_path / "run-copy")
    result = run(plan_for(server, tmp_path, keys=["keep"]))
    assert result["removed"] == 1 and not (root / "gone").exists()
    assert (tmp_path / "run-copy").read_bytes() == b"x"


def test_slow_down_is_waited_out(server, tmp_path):
    server.objects = {"busy": Served(b"data" * 10, slow_downs=3)}
    result = run(plan_for(server, tmp_path))
    assert result["ok"] and result["retries"] == 3, result


def test_an_object_changed_since_the_listing_is_named_not_mixed(server, tmp_path):
    server.objects = {"a": Served(b"old"), "b": Served(b"fine")}
    plan = plan_for(server, tmp_path)
    server.objects["a"] = Served(b"new content")  # after the listing
    result = run(plan)
    assert not result["ok"] and [c[0] for c in result["changed"]] == ["a"], result
    assert "412" in result["changed"][0][1]
    root = tmp_path / "data" / "s3-b-12345678"
    assert not (root / "a").exists() and (root / "b").read_bytes() == b"fine"


def test_a_body_that_does_not_match_its_md5_is_not_kept(server, tmp_path):
    good = Served(b"what was listed")
    server.objects = {"a": Served(b"what was served!", etag=good.etag)}  # same ETag, other bytes
    result = run(plan_for(server, tmp_path))
    assert [c[0] for c in result["changed"]] == ["a"] and "MD5" in result["changed"][0][1], result
    assert not (tmp_path / "data" / "s3-b-12345678" / "a").exists()


def test_an_object_encrypted_with_a_kms_key_is_checked_by_size_its_etag_being_no_md5(server, tmp_path):
    server.objects = {"kms": Served(b"ciphertext-backed", etag="0123456789abcdef0123456789abcdef",
                                    headers={"x-amz-server-side-encryption": "aws:kms"}),
                      "plain": Served(b"plain", etag="0123456789abcdef0123456789abcdef")}
    result = run(plan_for(server, tmp_path))
    assert result["fetched"] == 1 and [c[0] for c in result["changed"]] == ["plain"], result
    assert (tmp_path / "data" / "s3-b-12345678" / "kms").read_bytes() == b"ciphertext-backed"


def test_hostile_keys_are_refused_and_named_and_nothing_lands_outside(server, tmp_path):
    hostile = ["../outside", "/abs", "a//b", "esc\x1b]0;x\x07", "x" * 300]
    server.objects = {k: Served(b"evil") for k in hostile} | {"fine": Served(b"ok")}
    result = run(plan_for(server, tmp_path))
    assert sorted(r[0] for r in result["refused"]) == sorted(hostile)
    assert not result["ok"] and result["fetched"] == 1
    assert not (tmp_path / "data" / "outside").exists() and not (tmp_path / "outside").exists()
    assert all(k == "fine" for k, _ in server.requests)  # never asked for


def test_a_link_planted_in_the_data_dir_is_not_followed(server, tmp_path):
    root = tmp_path / "data" / "s3-b-12345678"
    root.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "sub").symlink_to(tmp_path / "elsewhere")
    server.objects = {"sub/file": Served(b"x")}
    result = run(plan_for(server, tmp_path))
    assert result["fetched"] == 1 and os.listdir(tmp_path / "elsewhere") == []
    assert not (root / "sub").is_symlink() and (root / "sub" / "file").read_bytes() == b"x"


def test_a_disk_too_small_is_refused_before_anything_is_fetched(server, tmp_path):
    server.objects = {"a": Served(b"x")}
    plan = plan_for(server, tmp_path)
    plan["objects"][0][1] = 1 << 60  # the listing says an exabyte
    assert cache.need(cache.load_plan_data(plan))["need"] == 1 << 60
    result = run(plan)
    assert result["error"] == "short" and result["need"] == 1 << 60 and server.requests == []


def test_a_cut_fetch_goes_on_where_it_stopped(server, tmp_path):
    big = os.urandom(3 << 20)
    server.objects = {"big": Served(big, hold_after=1 << 20), "small-1": Served(b"1"), "small-2": Served(b"2")}
    path = write_plan(tmp_path, plan_for(server, tmp_path))
    proc = subprocess.Popen([sys.executable, str(PAYLOAD), "fetch", path])
    meta = Path(cache.meta_dir(str(tmp_path / "data" / "s3-b-12345678")))
    part = meta / "parts" / cache.part_name("big", server.objects["big"].etag)
    wait_for(lambda: part.exists() and part.stat().st_size >= 1 << 20 and
             (meta / "journal").exists() and len((meta / "journal").read_text().splitlines()) == 2,
             timeout=30, what="the small files fetched and the big one half")
    proc.send_signal(signal.SIGKILL)  # as a stop or a preemption cuts it
    proc.wait()
    server.objects["big"].hold_after = None
    server.requests.clear()
    result = run(plan_for(server, tmp_path))
    assert result["ok"] and (result["fetched"], result["cached"]) == (1, 2), result
    (asked,) = server.asked("big")
    assert asked["range"] == f"bytes={part_size_of(asked)}-" and int(part_size_of(asked)) >= 1 << 20
    assert hashlib.md5((tmp_path / "data" / "s3-b-12345678" / "big").read_bytes()).hexdigest() == hashlib.md5(big).hexdigest()
    assert os.listdir(meta / "parts") == []


def part_size_of(headers: dict[str, str]) -> str:
    return headers["range"].split("=")[1].rstrip("-")


def test_the_command_line_prints_a_summary_and_writes_status_and_result(server, tmp_path):
    server.objects = {"a": Served(b"abc")}
    path = write_plan(tmp_path, plan_for(server, tmp_path))
    need = subprocess.run([sys.executable, str(PAYLOAD), "need", path], capture_output=True, text=True, check=True)
    assert json.loads(need.stdout)["missing"] == [0]
    done = subprocess.run([sys.executable, str(PAYLOAD), "fetch", path], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    meta = Path(cache.meta_dir(str(tmp_path / "data" / "s3-b-12345678")))
    names = sorted(os.listdir(meta))
    assert [n.split(".")[0] for n in names if n.endswith(".json") and n != "manifest.json"] == ["result", "status"]


def test_on_an_aws_instance_the_links_are_signed_there_with_the_role_s_own_credentials(server, tmp_path, imds):
    """No links in the plan: the payload reads its role's credentials from the (fake) IMDSv2 and
    signs each GET itself; a 403 (a policy put a moment ago, not in force yet) is tried again."""
    imds.role("gpuctl-cluster-role", access_key="ASIAROLEKEY", secret_key="role-secret")
    server.objects = {"a": Served(b"alpha", forbidden=2), "b/c": Served(b"c")}
    plan = plan_for(server, tmp_path)
    for obj in plan["objects"]:
        obj[3] = None
    port = server.httpd.server_address[1]
    plan["sign"] = {"imds": imds.url(), "bucket": "bkt", "prefix": "", "region": "eu-west-1",
                    "endpoint": f"http://127.0.0.1:{port}", "virtual": False}
    server.objects = {f"bkt/{k}": v for k, v in server.objects.items()}  # path style: /bucket/key
    result = run(plan)
    assert result["ok"] and result["fetched"] == 2 and result["retries"] == 2, result
    asked = [urllib.parse.urlsplit(p) for p in server.paths]
    assert all("X-Amz-Credential=ASIAROLEKEY%2F" in u.query and "X-Amz-Security-Token=fake-session-token" in u.query
               for u in asked), asked
    assert (tmp_path / "data" / "s3-b-12345678" / "b" / "c").read_bytes() == b"c"

"""`gpuctl data push DIR --name NAME` (issue 38 item 3): a local directory uploaded once to the
gpuctl bucket of the region (moto's S3 over HTTP), changed files only, and trained from as
`--data gpuctl:NAME` by a local cluster, whose host fetches it from the bucket with links made here
(the s3:// fetch of tests/integration/test_s3_data.py). `data ls`, `data rm` (refused while a run
on a live cluster uses it, naming the cluster), the data sets' storage in `cost`.

Bad inputs tried, each one Error line with a Hint, a non-zero exit, nothing uploaded or recorded:
DIR missing, a file, empty; a bad --name; a directory whose name makes no data set name; `data rm`
of an unknown name and of a bad name; `train --data gpuctl:NAME` of an unknown or a bad name; no
AWS credentials."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpuctl.provision.aws.store import bucket_name
from tests.aws import moto_client
from tests.integration.test_s3_data import READER, files_seen, md5


@pytest.fixture
def s3_local(aws, monkeypatch):
    """moto's S3 and a local cluster (provider local; the aws fixture's credentials and endpoint)."""
    monkeypatch.setenv("GPUCTL_PROVIDER", "local")
    return moto_client("s3")


def tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, body in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(body)
    return root


def keys(s3) -> dict[str, int]:
    out = {}
    for b in s3.list_buckets()["Buckets"]:
        for o in s3.list_objects_v2(Bucket=b["Name"], Prefix="data/").get("Contents", []):
            out[o["Key"]] = o["Size"]
    return out


def one_line_error(res, needle: str) -> str:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert lines[0].startswith("Error: ") and needle in lines[0], res.stderr
    assert any(x.startswith("Hint: ") for x in lines), res.stderr
    return res.stderr


def test_push_once_train_from_the_bucket_push_changes_only_ls_cost_rm(gpuctl, s3_local, make_project, tmp_path):
    body = os.urandom(300_000)
    src = tree(tmp_path / "Cifar_10", {"train/a.bin": body, "train/b.bin": b"bee" * 1000, "labels.txt": b"cat\n"})
    first = json.loads(gpuctl("data", "push", src, "--json").stdout)
    bucket = first["snapshot"]["bucket"]
    assert first["snapshot"]["name"] == "cifar-10" and bucket.startswith("gpuctl-")  # the checkpoint store's bucket
    assert (first["uploaded"], first["unchanged"], first["snapshot"]["files"]) == (3, 0, 3)
    assert keys(s3_local) == {"data/cifar-10/train/a.bin": 300_000, "data/cifar-10/train/b.bin": 3000,
                              "data/cifar-10/labels.txt": 4}
    assert not [p for p in src.rglob("*") if p.name.startswith(".gpuctl")], "nothing of gpuctl's in the user's dir"

    # Again, unchanged: nothing uploaded. One file changed, one gone, one new: those alone.
    again = json.loads(gpuctl("data", "push", src, "--name", "cifar-10", "--json").stdout)
    assert (again["uploaded"], again["unchanged"], again["deleted"]) == (0, 3, 0)
    (src / "labels.txt").write_bytes(b"cat\ndog\n")
    (src / "train" / "b.bin").unlink()
    (src / "new.txt").write_bytes(b"new")
    third = json.loads(gpuctl("data", "push", src, "--name", "cifar-10", "--json").stdout)
    assert (third["uploaded"], third["unchanged"], third["deleted"]) == (2, 1, 1)
    assert set(keys(s3_local)) == {"data/cifar-10/train/a.bin", "data/cifar-10/labels.txt", "data/cifar-10/new.txt"}

    listed = json.loads(gpuctl("data", "ls", "--json").stdout)["snapshots"]
    assert [(v["name"], v["files"], v["bytes"], v["last_used_at"]) for v in listed] == [
        ("cifar-10", 3, 300_000 + 8 + 3, None)]
    assert "never" in gpuctl("data", "ls").stdout

    # A local cluster trains from it: its host fetches from the bucket, nothing pushed from here.
    proj = make_project("reader", {"train.py": READER})
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    out = gpuctl("train", proj, "--data", "gpuctl:cifar-10", "--json")
    assert f"data: s3://{bucket}/data/cifar-10/ (from gpuctl:cifar-10): 3 objects" in out.stderr
    result = json.loads(out.stdout)
    assert result["data_fetch"]["fetched"] == 3 and result["run"]["data"] == f"s3://{bucket}/data/cifar-10/"
    assert files_seen(gpuctl, result["run"]["run_id"]) == {
        "train/a.bin": md5(body), "labels.txt": md5(b"cat\ndog\n"), "new.txt": md5(b"new")}
    assert json.loads(gpuctl("data", "ls", "--json").stdout)["snapshots"][0]["last_used_at"] is not None

    cost = json.loads(gpuctl("cost", "--json").stdout)["data"]
    assert [v["name"] for v in cost["snapshots"]] == ["cifar-10"] and cost["usd_per_month"] > 0
    assert "Data sets: 1 kept" in gpuctl("cost").stdout

    gpuctl("data", "rm", "cifar-10", "-y")
    assert keys(s3_local) == {} and json.loads(gpuctl("data", "ls", "--json").stdout)["snapshots"] == []
    cost = json.loads(gpuctl("cost", "--json").stdout)["data"]
    assert cost["usd_per_month"] == 0 and cost["snapshots"][0]["removed_at"] is not None  # its dollars stay
    one_line_error(gpuctl("train", proj, "--data", "gpuctl:cifar-10", code=4), "no data set named 'cifar-10'")


def test_rm_is_refused_while_a_running_run_uses_it(gpuctl, s3_local, make_project, tmp_path):
    go = tmp_path / "go"
    waiter = f'''
import os, time
while not os.path.exists({str(go)!r}):
    time.sleep(0.05)
print("done", flush=True)
'''
    gpuctl("data", "push", tree(tmp_path / "d", {"x": b"x"}), "--name", "inuse")
    gpuctl("up", "--name", "busy", "-y")
    run = json.loads(gpuctl("train", make_project("w", {"train.py": waiter}), "--data", "gpuctl:inuse",
                            "--json").stdout)["run"]
    err = one_line_error(gpuctl("data", "rm", "inuse", "-y", code=5), "cluster 'busy'")
    assert run["run_id"] in err and len(keys(s3_local)) == 1
    go.write_text("")
    assert "done" in gpuctl("logs", run["run_id"], "-f").stdout
    gpuctl("data", "rm", "inuse", "-y")
    assert keys(s3_local) == {}


@pytest.mark.parametrize("make, args, code, said", [
    (lambda p: p / "missing", (), 6, "does not exist"),
    (lambda p: (p / "f").write_text("x") and p / "f", (), 6, "is a file"),
    (lambda p: (p / "empty" / "sub").mkdir(parents=True) or p / "empty", (), 12, "holds no files"),
    (lambda p: tree(p / "ok", {"a": b"a"}), ("--name", "Bad_Name"), 3, "--name 'Bad_Name' is not allowed"),
    (lambda p: tree(p / "ok", {"a": b"a"}), ("--name", "x" * 41), 3, "is not allowed"),
    (lambda p: tree(p / "___", {"a": b"a"}), (), 3, "makes no data set name"),
])
def test_bad_pushes_are_one_line_and_upload_nothing(gpuctl, s3_local, tmp_path, make, args, code, said):
    directory = make(tmp_path)
    one_line_error(gpuctl("data", "push", directory, *args, code=code), said)
    assert s3_local.list_buckets()["Buckets"] == [] and json.loads(gpuctl("data", "ls", "--json").stdout)["snapshots"] == []


@pytest.mark.parametrize("args, code, said", [
    (("data", "rm", "nope", "-y"), 4, "no data set named 'nope'"),
    (("data", "rm", "No/pe", "-y"), 3, "is not allowed"),
])
def test_rm_of_an_unknown_or_bad_name(gpuctl, s3_local, args, code, said):
    one_line_error(gpuctl(*args, code=code), said)


@pytest.mark.parametrize("url, code, said", [
    ("gpuctl:nope", 4, "no data set named 'nope'"),
    ("gpuctl:Bad\x1b[2J", 3, "is not allowed"),
    ("gpuctl:", 3, "is not allowed"),
])
def test_train_from_an_unknown_or_bad_data_set_starts_nothing(gpuctl, s3_local, make_project, url, code, said):
    gpuctl("up", "-y")
    err = one_line_error(gpuctl("train", make_project("r", {"train.py": READER}), "--data", url, code=code), said)
    assert "\x1b" not in err
    assert json.loads(gpuctl("status", "--json").stdout)["runs"] == []


def test_without_aws_credentials_push_says_so_and_records_nothing(gpuctl, s3_local, tmp_path, monkeypatch):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    one_line_error(gpuctl("data", "push", tree(tmp_path / "d", {"a": b"a"}), code=9), "no AWS credentials")
    assert json.loads(gpuctl("data", "ls", "--json").stdout)["snapshots"] == []


def test_the_snapshot_bucket_is_the_checkpoint_store_s(gpuctl, s3_local, tmp_path, isolated):
    from gpuctl.provision.aws.access import owner_id

    gpuctl("data", "push", tree(tmp_path / "d", {"a": b"a"}), "--name", "d")
    mine = bucket_name("123456789012", "us-east-1", owner_id(isolated))
    assert [b["Name"] for b in s3_local.list_buckets()["Buckets"]] == [mine]


def test_a_push_cut_short_is_recorded_incomplete_refused_by_train_and_completed_by_the_next(
        gpuctl, s3_local, make_project, tmp_path, monkeypatch):
    from gpuctl.errors import CloudError
    from gpuctl.provision.aws import snapshots

    src = tree(tmp_path / "d", {f"f{i}": bytes([i]) * 10 for i in range(4)})
    real, sent = snapshots._Bucket.upload, []

    def cut(self, path, key):
        # Stands in for S3 failing mid-push (moto cannot fail one PUT of several): the third fails.
        if len(sent) == 2:
            raise CloudError("S3 did not answer (PutObject)")
        sent.append(key)
        real(self, path, key)

    monkeypatch.setattr(snapshots._Bucket, "upload", cut)
    err = gpuctl("data", "push", src, "--name", "cut", code=9).stderr
    assert "Error: S3 did not answer (PutObject)\nHint: " in err
    monkeypatch.setattr(snapshots._Bucket, "upload", real)
    (row,) = json.loads(gpuctl("data", "ls", "--json").stdout)["snapshots"]
    assert (row["name"], row["complete"]) == ("cut", False) and len(keys(s3_local)) == 2
    assert "cut (incomplete)" in gpuctl("data", "ls").stdout
    gpuctl("up", "-y")
    proj = make_project("r", {"train.py": READER})
    one_line_error(gpuctl("train", proj, "--data", "gpuctl:cut", code=12), "is incomplete")
    assert json.loads(gpuctl("status", "--json").stdout)["runs"] == []

    done = json.loads(gpuctl("data", "push", src, "--name", "cut", "--json").stdout)
    assert done["snapshot"]["complete"] and done["snapshot"]["files"] == 4 and len(keys(s3_local)) == 4
    run = json.loads(gpuctl("train", proj, "--data", "gpuctl:cut", "--json").stdout)["run"]
    assert len(files_seen(gpuctl, run["run_id"])) == 4


def test_upload_dirs_is_the_user_s_setting_alone_and_for_aws_clusters_only(gpuctl, s3_local, make_project, tmp_path,
                                                                          monkeypatch):
    """`[data] upload_dirs` (item 3's "--data DIR on aws with a setting that does this by itself"):
    a project's gpuctl.toml cannot turn it on (a project is data: it must not make gpuctl upload
    anything), and a local cluster gets DIR pushed as before even with the user's setting on.
    Uploaded and fetched on aws: tests/integration/test_s3_data_ssh.py."""
    src = tree(tmp_path / "d", {"a.txt": b"a", "sub/b.txt": b"b"})
    proj = make_project("r", {"train.py": READER, "gpuctl.toml": "[data]\nupload_dirs = true\n"})
    gpuctl("up", "-y")
    out = gpuctl("train", proj, "--data", src, "--json")
    assert "Note: ignored in" in out.stderr and "data.upload_dirs" in out.stderr
    assert json.loads(out.stdout)["data_sync"] is not None and keys(s3_local) == {}
    monkeypatch.setenv("GPUCTL_DATA__UPLOAD_DIRS", "true")
    out = gpuctl("train", proj, "--data", src, "--json")
    assert json.loads(out.stdout)["data_sync"] is not None and keys(s3_local) == {}
    assert json.loads(gpuctl("data", "ls", "--json").stdout)["snapshots"] == []


def test_the_data_set_a_directory_goes_up_as_is_named_after_it_and_where_it_is(tmp_path):
    from gpuctl.ops.snapshots import dir_name

    a, b = tree(tmp_path / "x" / "My_Data", {"f": b"1"}), tree(tmp_path / "y" / "My_Data", {"f": b"1"})
    assert dir_name(a).startswith("my-data-") and len(dir_name(a)) == len("my-data-") + 8
    assert dir_name(a) != dir_name(b) and dir_name(a) == dir_name(tmp_path / "x" / "My_Data")


def test_data_sets_are_listed_by_status_all_and_kept_by_down_all(gpuctl, s3_local, tmp_path):
    """Like volumes: `status --all` shows the data sets' storage, `down --all` leaves them (they
    hold data) and says so with their $/month and how to delete each; --json of both too."""
    gpuctl("data", "push", tree(tmp_path / "d", {"a": b"a" * 2000}), "--name", "kept-set")
    gpuctl("up", "-y")
    every = gpuctl("status", "--all")
    assert "Data sets: 1 kept, 0.00 GB" in every.stdout and "kept-set:" in every.stdout
    (row,) = json.loads(gpuctl("status", "--all", "--json").stdout)["data"]["snapshots"]
    assert (row["name"], row["files"], row["bytes"]) == ("kept-set", 1, 2000)
    out = gpuctl("down", "--all", "-y").stdout
    assert "kept: data set kept-set (2.0 KB, $0.0000/month); `gpuctl data rm kept-set` deletes it" in out
    gpuctl("up", "-y")
    down = json.loads(gpuctl("down", "--all", "-y", "--json").stdout)
    assert down["kept"] == [{"kind": "data set", "name": "kept-set", "size": "2.0 KB", "usd_per_month": row["monthly_usd"],
                             "remove": "gpuctl data rm kept-set"}]
    assert "kept-set" in keys(s3_local).__repr__()


def test_a_push_killed_half_way_is_resumed_by_the_next_which_sends_only_the_rest(gpuctl, s3_local, tmp_path,
                                                                               monkeypatch):
    """A real `gpuctl data push` process killed (SIGKILL: no cleanup of any kind) once part of the
    directory is in the bucket: the next push uploads only what had not gone up (its PUTs counted)."""
    import signal
    import subprocess
    import sys

    from gpuctl.provision.aws import snapshots
    from tests.waits import wait_for

    total = 300
    src = tree(tmp_path / "big", {f"d/f{i:03d}.bin": bytes([i % 256]) * 2000 for i in range(total)})
    proc = subprocess.Popen([sys.executable, "-m", "gpuctl", "data", "push", str(src), "--name", "half"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    try:
        wait_for(lambda: len(keys(s3_local)) >= 40 or proc.poll() is not None, timeout=120, what="40 files up")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    there = len(keys(s3_local))
    assert there < total, "the push ended before it was killed: make the directory bigger"
    real, puts = snapshots._Bucket.upload, []

    def counted(self, path, key):
        puts.append(key)
        real(self, path, key)

    monkeypatch.setattr(snapshots._Bucket, "upload", counted)
    done = json.loads(gpuctl("data", "push", src, "--name", "half", "--json").stdout)
    # Each upload is journaled once S3 took it: at most the one in flight at the kill goes again.
    assert total - there <= len(puts) <= total - there + 1, (there, len(puts))
    assert done["uploaded"] == len(puts) and done["snapshot"]["complete"] and done["snapshot"]["files"] == total
    assert len(keys(s3_local)) == total
    again = json.loads(gpuctl("data", "push", src, "--name", "half", "--json").stdout)
    assert (again["uploaded"], again["unchanged"]) == (0, total)

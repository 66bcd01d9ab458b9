"""`train --data s3://BUCKET/PREFIX` (issue 38, items 1 and 2) on the local provider, against the
tests' moto S3 over HTTP: the host (this machine, as the local provider's instance) fetches with
presigned links made here, into the data store, and the run sees it at $GPUCTL_DATA_DIR as a
pushed --data. The cache: a second train fetches nothing, a changed object comes again. Bad
inputs, each one line with a hint, nothing started: a malformed URL, no such bucket, access
denied, an empty prefix, hostile keys planted in the bucket, a disk too small (root: tmpfs).
The sshd hosts' fetch is tests/integration/test_s3_data_ssh.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.aws import moto_client

READER = '''
import hashlib, os, sys
data = os.environ["GPUCTL_DATA_DIR"]
for top, _, files in sorted(os.walk(data)):
    for name in sorted(files):
        path = os.path.join(top, name)
        print("file", os.path.relpath(path, data), hashlib.md5(open(path, "rb").read()).hexdigest(), flush=True)
print("done", flush=True)
'''
BUCKET = "training-data"


@pytest.fixture
def s3_local(aws, monkeypatch):
    """moto's S3 for a local cluster: the aws fixture's credentials and endpoint, provider local."""
    monkeypatch.setenv("GPUCTL_PROVIDER", "local")
    return moto_client("s3")


def put(s3, objects: dict[str, bytes], bucket: str = BUCKET) -> None:
    if bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket=bucket)
    for key, body in objects.items():
        s3.put_object(Bucket=bucket, Key=key, Body=body)


def runs(gpuctl) -> list[dict]:
    return json.loads(gpuctl("status", "--json").stdout)["runs"]


def files_seen(gpuctl, run_id: str) -> dict[str, str]:
    log = gpuctl("logs", run_id, "-f").stdout
    assert "done" in log, log
    return {line.split()[1]: line.split()[2] for line in log.splitlines() if line.startswith("file ")}


def md5(body: bytes) -> str:
    import hashlib

    return hashlib.md5(body).hexdigest()


def test_train_fetches_an_s3_data_set_keeps_it_and_fetches_a_changed_object_again(gpuctl, s3_local, make_project):
    objects = {"cifar/train/a.bin": os.urandom(200_000), "cifar/train/b.bin": b"bee" * 1000,
               "cifar/labels.txt": b"cat\ndog\n", "cifar/empty-folder/": b"", "elsewhere/x": b"not ours"}
    put(s3_local, objects)
    proj = make_project("reader", {"train.py": READER})
    gpuctl("up", "--usd-per-hour", "3.6", "-y")

    first = gpuctl("train", proj, "--data", f"s3://{BUCKET}/cifar", "--json")
    result = json.loads(first.stdout)
    assert "data: s3://training-data/cifar/: 3 objects, 203.0 KB" in first.stderr
    assert "bucket in us-east-1; this host is outside AWS" in first.stderr
    assert result["data_fetch"]["fetched"] == 3 and result["data_fetch"]["cached"] == 0
    run = result["run"]
    assert run["data"] == "s3://training-data/cifar/" and run["data_fetch_s"] is not None
    assert files_seen(gpuctl, run["run_id"]) == {
        "train/a.bin": md5(objects["cifar/train/a.bin"]), "train/b.bin": md5(objects["cifar/train/b.bin"]),
        "labels.txt": md5(objects["cifar/labels.txt"])}
    store = Path(result["data_fetch"]["data_dir"])
    assert store.parent.name == "data" and store.name.startswith("s3-training-data-")
    assert not list(store.parent.glob(".*/plan.json")), "the links are not left on the host"
    # status says what the fetch took; cost what the machine's time waiting for it cost.
    assert f"{run['run_id']}: data: s3://training-data/cifar/, 203.0 KB fetched in" in gpuctl("status", run["run_id"]).stdout
    cost = json.loads(gpuctl("cost", "--json").stdout)["runs"][0]
    assert cost["data_fetch_s"] == run["data_fetch_s"] and cost["data_fetch_usd"] == run["data_fetch_s"] * 3.6 / 3600
    assert "its S3 data set was fetched in" in gpuctl("cost", run["run_id"]).stdout

    # The same data again: nothing fetched. Then one object changes: that one alone comes again.
    second = json.loads(gpuctl("train", proj, "--data", f"s3://{BUCKET}/cifar/", "--json").stdout)
    assert (second["data_fetch"]["fetched"], second["data_fetch"]["cached"]) == (0, 3)
    put(s3_local, {"cifar/labels.txt": b"cat\ndog\nbird\n"})
    third = json.loads(gpuctl("train", proj, "--data", f"s3://{BUCKET}/cifar", "--json").stdout)
    assert (third["data_fetch"]["fetched"], third["data_fetch"]["cached"]) == (1, 2)
    assert files_seen(gpuctl, third["run"]["run_id"])["labels.txt"] == md5(b"cat\ndog\nbird\n")
    # The first run's own copy is what it was submitted with.
    assert (Path(run["run_dir"]) / "data" / "labels.txt").read_bytes() == b"cat\ndog\n"


def test_a_project_s_gpuctl_toml_names_its_data_set(gpuctl, s3_local, make_project):
    put(s3_local, {"set/one": b"1"})
    proj = make_project("reader", {"train.py": READER, "gpuctl.toml": f'[train]\ndata = "s3://{BUCKET}/set"\n'})
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    out = gpuctl("train", proj, "--json")
    assert f"data: s3://{BUCKET}/set/ (from {proj / 'gpuctl.toml'})" in out.stderr
    assert files_seen(gpuctl, json.loads(out.stdout)["run"]["run_id"]) == {"one": md5(b"1")}


def nothing_started(gpuctl) -> None:
    assert runs(gpuctl) == []


@pytest.mark.parametrize("url, said", [
    ("s3:/training-data/x", "is not an s3:// URL"),
    ("S3://training-data/x", "the scheme is s3://, lowercase"),
    ("s3://", "names no bucket"),
    ("s3://Bad_Bucket/x", "is not an S3 bucket name"),
    ("s3://training-data/a*/b", "without wildcards"),
    ("s3://training-data/a\x1b[2Jb", "control character"),
])
def test_a_malformed_url_is_one_line_and_starts_nothing(gpuctl, s3_local, make_project, url, said):
    proj = make_project("reader", {"train.py": READER})
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    out = gpuctl("train", proj, "--data", url, code=12)
    assert said in out.stderr and "Hint:" in out.stderr and "\x1b" not in out.stderr
    assert len([line for line in out.stderr.splitlines() if line.startswith("Error:")]) == 1
    nothing_started(gpuctl)


def test_a_missing_bucket_an_empty_prefix_and_denied_access_start_nothing(gpuctl, s3_local, make_project, monkeypatch):
    put(s3_local, {"full/x": b"x"})
    proj = make_project("reader", {"train.py": READER})
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    out = gpuctl("train", proj, "--data", "s3://no-such-bucket-here/x", code=12)
    assert "Error: bucket 'no-such-bucket-here' does not exist" in out.stderr and "Hint:" in out.stderr
    out = gpuctl("train", proj, "--data", f"s3://{BUCKET}/empty", code=12)
    assert "Error: s3://training-data/empty/ holds no objects" in out.stderr and "not one file" in out.stderr
    # An IAM user with no S3 permission, and moto enforcing IAM from now on (in this process: the
    # ThreadedMotoServer's own settings; monkeypatch puts them back).
    iam = moto_client("iam")
    iam.create_user(UserName="nobody")
    key = iam.create_access_key(UserName="nobody")["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin

    monkeypatch.setattr(ActionAuthenticatorMixin, "request_count", 0)
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    out = gpuctl("train", proj, "--data", f"s3://{BUCKET}/full", code=12)
    assert "Error: access denied to bucket 'training-data'" in out.stderr and "s3:GetObject" in out.stderr
    nothing_started(gpuctl)


def test_hostile_keys_in_the_bucket_are_refused_and_named_before_anything_starts(gpuctl, s3_local, make_project, isolated):
    hostile = ["set/../../escape", "set/a//b", "set/\x1b]0;pwned\x07", "set/" + "x" * 300]
    put(s3_local, {k: b"evil" for k in hostile} | {"set/fine": b"ok", "set/fine/under": b"clash"})
    proj = make_project("reader", {"train.py": READER})
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    out = gpuctl("train", proj, "--data", f"s3://{BUCKET}/set", code=12)
    assert "holds 5 key(s) gpuctl will not write as files" in out.stderr
    for why in ("a '.' or '..' part", "an empty part", "a control character", "a name over 255 bytes",
                "its directory fine is another object"):
        assert why in out.stderr, why
    assert "\x1b" not in out.stderr and "\x07" not in out.stderr
    nothing_started(gpuctl)
    assert not list(isolated.rglob("escape")) and not list(isolated.rglob("s3-training-data-*"))


def test_sync_and_plan_say_an_s3_data_set_is_train_s(gpuctl, s3_local, make_project):
    proj = make_project("reader", {"train.py": READER})
    for command in (("sync", proj), ("plan", proj, "--cluster", "default", "--epochs", "5")):
        out = gpuctl(*command, "--data", "s3://bucket/x", code=12)
        assert "is fetched by `gpuctl train --data` itself" in out.stderr and "Hint:" in out.stderr


def test_a_disk_too_small_for_the_data_is_refused_before_the_push(gpuctl, s3_local, make_project, small_disk,
                                                                   monkeypatch):
    home = small_disk(16)  # MB
    monkeypatch.setenv("GPUCTL_HOME", str(home))
    put(s3_local, {"big/a": os.urandom(10 << 20), "big/b": os.urandom(10 << 20)})
    proj = make_project("reader", {"train.py": READER})
    gpuctl("up", "--usd-per-hour", "3.6", "-y")
    out = gpuctl("train", proj, "--data", f"s3://{BUCKET}/big", code=12)
    assert "needs 21.0 MB more on" in out.stderr and "--disk-gb" in out.stderr
    nothing_started(gpuctl)
    assert not list(home.rglob("code"))  # the project was not pushed


# A run that checkpoints as the launcher's Keras hook would (tests/integration/test_kept_runs.py),
# and reads its data each attempt: resumed elsewhere, it finds the data there, fetched anew.
CHECKPOINTS_AND_DATA = '''
import os, sys
print("data", sorted(os.listdir(os.environ["GPUCTL_DATA_DIR"])), flush=True)
ckpt = os.path.join(os.environ["GPUCTL_OUTPUT_DIR"], "checkpoint")
if os.path.isdir(ckpt):
    print("resumed", flush=True)
    sys.exit(0)
os.makedirs(ckpt)
open(os.path.join(ckpt, "chief"), "w").write("epoch 1\\n")
sys.exit(3)
'''


def test_a_run_resumed_on_another_cluster_fetches_its_data_there_with_new_links(gpuctl, s3_local, make_project,
                                                                                isolated):
    put(s3_local, {"res/a": b"a", "res/b": b"b"})
    proj = make_project("ckpt", {"train.py": CHECKPOINTS_AND_DATA})
    gpuctl("up", "--name", "one", "--usd-per-hour", "3.6", "-y")
    gpuctl("train", proj, "--cluster", "one", "--data", f"s3://{BUCKET}/res", "--wait", code=8)
    run_id = runs(gpuctl)[0]["run_id"]
    gpuctl("down", "one", "-y")
    gpuctl("up", "--name", "two", "--usd-per-hour", "3.6", "-y")
    out = gpuctl("train", "--resume", run_id, "--cluster", "two")
    assert f"data: s3://{BUCKET}/res/: 2 objects" in out.stderr
    gpuctl("logs", "-f", run_id)
    log = gpuctl("logs", run_id).stdout
    assert "data ['a', 'b']" in log and "resumed" in log
    (run,) = runs(gpuctl)
    assert run["cluster"] == "two"
    assert list((isolated / "clusters" / "two").rglob("s3-training-data-*/a"))


def test_a_fetch_killed_half_way_goes_on_where_it_stopped_at_the_next_train(gpuctl, s3_local, make_project,
                                                                             moto_server, monkeypatch, isolated):
    """A proxy in front of moto holds one object's body after 1 MB (tests/objects_http.py); the
    fetch is killed there, as a stop or a preemption kills it. The next train fetches only the
    rest of that object (a Range request from where its part ended), nothing else again."""
    import signal

    from tests.integration.test_spot_recovery import finished, train_in_background
    from tests.objects_http import HoldingProxy
    from tests.waits import wait_for

    big = os.urandom(4 << 20)
    put(s3_local, {"cut/big.bin": big, "cut/s1": b"1", "cut/s2": b"2"})
    proxy = HoldingProxy(upstream=moto_server, hold=f"{BUCKET}/cut/big.bin", hold_after=1 << 20).start()
    monkeypatch.setenv("GPUCTL_TEST_S3_ENDPOINT", proxy.url)  # where the host's links point
    try:
        proj = make_project("reader", {"train.py": READER})
        gpuctl("up", "--usd-per-hour", "3.6", "-y")
        thread, out = train_in_background(gpuctl, ("train", proj, "--data", f"s3://{BUCKET}/cut"), code=12)

        def half_way() -> Path | None:
            for meta in isolated.rglob(".s3-training-data-*.gpuctl-fetch"):
                parts = list((meta / "parts").glob("*"))
                journal = meta / "journal"
                status = list(meta.glob("status.*.json"))
                if parts and parts[0].stat().st_size >= 1 << 20 and status and journal.exists() \
                        and len(journal.read_text().splitlines()) == 2:
                    return status[0]
            return None

        status = wait_for(half_way, 60, "the small files fetched and the big one a quarter")
        os.kill(int(status.name.split(".")[1]), signal.SIGKILL)
        err = finished(thread, out).stderr
        assert "ended without a result (killed?)" in err and "goes on where it stopped" in err
        nothing_started(gpuctl)

        proxy.release.set()
        proxy.requests.clear()
        again = json.loads(gpuctl("train", proj, "--data", f"s3://{BUCKET}/cut", "--json").stdout)
        assert (again["data_fetch"]["fetched"], again["data_fetch"]["cached"]) == (1, 2)
        (asked,) = proxy.asked(f"{BUCKET}/cut/big.bin")
        start = int(asked["range"].split("=")[1].rstrip("-"))
        assert start >= 1 << 20 and again["data_fetch"]["fetched_bytes"] == len(big)
        assert files_seen(gpuctl, again["run"]["run_id"])["big.bin"] == md5(big)
    finally:
        proxy.close()


def test_an_object_overwritten_while_it_is_fetched_is_fetched_again_after_a_new_listing(gpuctl, s3_local, make_project,
                                                                                       moto_server, monkeypatch):
    """Half of the old bytes arrived when the object is overwritten: the rest is asked for with
    the listed ETag (If-Match), S3 answers 412, and train lists again and fetches the new object
    whole; the old and new bytes are never mixed."""
    from tests.integration.test_spot_recovery import finished, train_in_background
    from tests.objects_http import HoldingProxy
    from tests.waits import wait_for

    old, new = os.urandom(2 << 20), os.urandom(3 << 20)
    put(s3_local, {"mid/big.bin": old, "mid/s1": b"1"})
    proxy = HoldingProxy(upstream=moto_server, hold=f"{BUCKET}/mid/big.bin", hold_after=512 << 10).start()
    monkeypatch.setenv("GPUCTL_TEST_S3_ENDPOINT", proxy.url)
    try:
        proj = make_project("reader", {"train.py": READER})
        gpuctl("up", "--usd-per-hour", "3.6", "-y")
        thread, out = train_in_background(gpuctl, ("train", proj, "--data", f"s3://{BUCKET}/mid", "--json"))
        wait_for(lambda: any(p.stat().st_size >= 512 << 10 for p in Path(os.environ["GPUCTL_HOME"]).rglob("parts/*")),
                 60, "half of the old object")
        put(s3_local, {"mid/big.bin": new})
        proxy.release.set()  # the held connection ends: the rest is asked for with the old ETag
        res = finished(thread, out)
        assert "1 object(s) changed while fetched ('big.bin'): listing again" in res.stderr
        result = json.loads(res.stdout)
        assert result["data_fetch"]["changed_again"] == ["big.bin"]
        assert files_seen(gpuctl, result["run"]["run_id"])["big.bin"] == md5(new)
        assert any(h.get("if-match") and h.get("range") for h in proxy.asked(f"{BUCKET}/mid/big.bin"))
    finally:
        proxy.close()


def test_a_data_set_fetched_onto_a_volume_is_found_warm_by_the_next_cluster_that_mounts_it(
        gpuctl, s3_local, make_project, isolated):
    objects = {f"warm/part-{i}.bin": os.urandom(10_000 + i) for i in range(5)}
    put(s3_local, objects)
    proj = make_project("reader", {"train.py": READER})
    volume = json.loads(gpuctl("volume", "create", "cache", "--size", "5", "--json").stdout)["path"]

    gpuctl("up", "--name", "first", "--volume", "cache")
    out = gpuctl("train", proj, "--cluster", "first", "--data", f"s3://{BUCKET}/warm", "--json")
    first = json.loads(out.stdout)
    assert (first["data_fetch"]["fetched"], first["data_fetch"]["cached"]) == (5, 0)
    assert first["data_fetch"]["data_dir"].startswith(os.path.join(volume, ".gpuctl-data", "s3-training-data-"))
    assert "data: kept on the cluster's volume" in out.stderr
    seen = files_seen(gpuctl, first["run"]["run_id"])
    assert seen == {k.split("/", 1)[1]: md5(v) for k, v in objects.items()}
    gpuctl("down", "first", "-y")

    # Another cluster without the volume has its own store: it fetches everything.
    gpuctl("up", "--name", "bare")
    bare = json.loads(gpuctl("train", proj, "--cluster", "bare", "--data", f"s3://{BUCKET}/warm", "--json").stdout)
    assert bare["data_fetch"]["fetched"] == 5
    gpuctl("down", "bare", "-y")

    # The next cluster that mounts the volume fetches nothing, and its run reads the same files.
    gpuctl("up", "--name", "second", "--volume", "cache")
    second = json.loads(gpuctl("train", proj, "--cluster", "second", "--data", f"s3://{BUCKET}/warm", "--json").stdout)
    assert (second["data_fetch"]["fetched"], second["data_fetch"]["cached"]) == (0, 5)
    assert files_seen(gpuctl, second["run"]["run_id"]) == seen
    # The runs' own copies are beside the store on the volume (hard links), the released cluster's gone.
    copies = os.path.join(volume, ".gpuctl-data", "runs")
    assert os.listdir(copies) == [second["run"]["run_id"]]
    gpuctl("down", "second", "-y")

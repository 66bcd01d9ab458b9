"""Volumes on the real local provider (real tmux, real files, real jobs): a volume created, given
to a cluster by `up --volume`, written by one cluster's job, kept by `down`, read back by the
next cluster's job, listed, refused removal while a cluster has it, removed. Its storage in
`cost` and `status --all`; `down --all` names it and leaves it.

Bad inputs tried, each a one-line Error + Hint that creates or deletes nothing: a bad name, a
size out of range, a name used already, `up --volume` of a volume that does not exist, of one
another live cluster has, of a bad name, `--zone` on a local volume, `volume rm` of one that
does not exist and of one a cluster has (the hint names the cluster to `down`)."""

import json
import os

import pytest

WRITE = '''
import os
vol = os.environ["GPUCTL_VOLUME_DIR"]
with open(os.path.join(vol, "dataset.txt"), "w") as fh:
    fh.write("fetched once\\n")
print("wrote", vol, flush=True)
'''

READ = '''
import os
vol = os.environ["GPUCTL_VOLUME_DIR"]
print("read:", open(os.path.join(vol, "dataset.txt")).read().strip(), flush=True)
'''


def _one_line_error(res, needle):
    err = res.stderr
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[0].startswith("Error: ") and needle in lines[0], err
    assert any(x.startswith("Hint: ") for x in lines), err
    return err


def test_a_volume_written_by_one_cluster_is_read_by_the_next(gpuctl, make_project, isolated):
    created = json.loads(gpuctl("volume", "create", "data", "--size", "5", "--json").stdout)
    path = created["path"]
    assert created["provider"] == "local" and path == str(isolated / "volumes" / "data") and os.path.isdir(path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o700"

    gpuctl("up", "--name", "first", "--volume", "data")
    (row,) = json.loads(gpuctl("volume", "ls", "--json").stdout)["volumes"]
    assert row["name"] == "data" and row["used_by"] == "first" and row["size_gb"] == 5
    assert "first" in gpuctl("volume", "ls").stdout

    # Refused while a cluster has it: the hint names the cluster to `down`; nothing is deleted.
    err = _one_line_error(gpuctl("volume", "rm", "data", "-y", code=5), "attached to cluster 'first'")
    assert "gpuctl down first" in err and os.path.isdir(path)
    # Another cluster cannot have it at the same time.
    err = _one_line_error(gpuctl("up", "--name", "second", "--volume", "data", code=5), "attached to cluster 'first'")
    assert "gpuctl down first" in err
    assert [c["name"] for c in json.loads(gpuctl("status", "--json").stdout)["clusters"]] == ["first"]

    out = gpuctl("train", make_project("writer", {"train.py": WRITE}), "--cluster", "first", "--wait").stdout
    assert "wrote " + path in out
    gpuctl("down", "first", "-y")
    assert open(os.path.join(path, "dataset.txt")).read() == "fetched once\n"  # it outlived `down`
    assert json.loads(gpuctl("volume", "ls", "--json").stdout)["volumes"][0]["used_by"] == ""

    gpuctl("up", "--name", "second", "--volume", "data")
    out = gpuctl("train", make_project("reader", {"train.py": READ}), "--cluster", "second", "--wait").stdout
    assert "read: fetched once" in out
    gpuctl("down", "second", "-y")

    gpuctl("volume", "rm", "data", "-y")
    assert not os.path.exists(path)
    assert json.loads(gpuctl("volume", "ls", "--json").stdout)["volumes"] == []
    _one_line_error(gpuctl("volume", "rm", "data", "-y", code=4), "no volume named 'data'")


def test_volumes_in_cost_status_all_and_down_all_which_keeps_them(gpuctl, isolated):
    gpuctl("volume", "create", "keep", "--size", "3")
    gpuctl("up", "--volume", "keep")
    cost = json.loads(gpuctl("cost", "--json").stdout)
    assert [v["name"] for v in cost["volumes"]["volumes"]] == ["keep"] and cost["volumes"]["gb"] == 3
    assert "Volumes: 1 kept, 3 GB" in gpuctl("cost").stdout
    every = gpuctl("status", "--all")
    assert "Volumes: 1 kept" in every.stdout
    assert json.loads(gpuctl("status", "--all", "--json").stdout)["volumes"]["volumes"][0]["used_by"] == "default"
    out = gpuctl("down", "--all", "-y").stdout
    assert "kept: volume keep (3 GB, $0.0000/month); `gpuctl volume rm keep` deletes it" in out
    assert (isolated / "volumes" / "keep").is_dir()


@pytest.mark.parametrize("args, code, needle", [
    (["volume", "create", "Bad_Name", "--size", "5"], 3, "volume name 'Bad_Name' is not allowed"),
    (["volume", "create", "-x", "--size", "5"], 2, ""),  # Click's: an option it does not know
    (["volume", "create", "big", "--size", "16385"], 3, "--size 16385 is out of range"),
    (["volume", "create", "none", "--size", "0"], 3, "--size 0 is out of range"),
    (["volume", "create", "zoned", "--size", "1", "--zone", "us-east-1a"], 3, "has no zones"),
    (["up", "--volume", "missing"], 4, "no volume named 'missing'"),
    (["up", "--volume", "../etc"], 3, "volume name '../etc' is not allowed"),
    (["volume", "rm", "missing", "-y"], 4, "no volume named 'missing'"),
])
def test_bad_volume_inputs_create_and_delete_nothing(gpuctl, isolated, args, code, needle):
    gpuctl("volume", "create", "there", "--size", "1")
    res = gpuctl(*args, code=code)
    if needle:
        _one_line_error(res, needle)
    assert sorted(os.listdir(isolated / "volumes")) == ["there"]
    assert [v["name"] for v in json.loads(gpuctl("volume", "ls", "--json").stdout)["volumes"]] == ["there"]
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []


def test_a_name_used_already_is_refused(gpuctl, isolated):
    gpuctl("volume", "create", "twice", "--size", "1")
    (isolated / "volumes" / "twice" / "f").write_text("kept")
    _one_line_error(gpuctl("volume", "create", "twice", "--size", "2", code=5), "a volume named 'twice' exists already")
    assert (isolated / "volumes" / "twice" / "f").read_text() == "kept"
    (row,) = json.loads(gpuctl("volume", "ls", "--json").stdout)["volumes"]
    assert row["size_gb"] == 1

"""Small things a new user hit in the first hour: script arguments given
before `--`, and `exec` of one shell line. Local provider, real tmux, plain-Python jobs."""

import json
import re


def test_a_script_option_before_the_double_dash_says_where_it_goes(gpuctl, quick_project):
    gpuctl("up", "--name", "c", "-y")
    res = gpuctl("train", quick_project, "--epochs", "3", code=2)
    assert "no such option" in res.stderr.lower() and "--epochs" in res.stderr
    assert f"gpuctl train {quick_project} -- --epochs 3" in res.stderr
    # Nothing started.
    assert json.loads(gpuctl("status", "--json").stdout)["runs"] == []


def test_exec_of_one_argument_runs_it_as_a_shell_line(gpuctl, tmp_path):
    gpuctl("up", "--name", "c", "-y")
    res = gpuctl("exec", "--json", "--", "echo one; echo $((1 + 2)) ~ | tr -d /")
    (out,) = json.loads(res.stdout)
    lines = out["stdout"].splitlines()
    assert lines[0] == "one" and lines[1].startswith("3 ") and "~" not in lines[1]
    # Several arguments stay words: nothing in them is the shell's.
    (words,) = json.loads(gpuctl("exec", "--json", "--", "echo", "a;b", "$HOME").stdout)
    assert words["stdout"] == "a;b $HOME\n"
    # A missing program is still the shell's 127.
    gpuctl("exec", "--", "no-such-program-here", code=127)


def test_status_and_cost_name_what_their_run_dollars_count(gpuctl, quick_project):
    # Both said "$ so far" / "$ spent" for one run with different figures and no word why.
    gpuctl("up", "--name", "c", "--usd-per-hour", "3.6", "-y")
    gpuctl("train", quick_project, "--wait")
    status = gpuctl("status").stdout
    cost = gpuctl("cost").stdout
    assert "$ on instance" in status and "$ so far" not in status.split("run ", 1)[1].splitlines()[0]
    assert "`gpuctl cost` counts its reported epochs only" in " ".join(status.split())
    assert "$ epochs" in cost and "$ spent" not in cost
    assert "`gpuctl status` counts its whole time, start-up included" in " ".join(cost.split())


def test_status_filters_to_one_run_or_one_cluster(gpuctl, quick_project):
    """Bad inputs: an unknown run (4), an unknown cluster (4), RUN with --all (2)."""
    gpuctl("up", "--name", "a", "-y")
    first = json.loads(gpuctl("train", quick_project, "--cluster", "a", "--wait", "--json").stdout)["run"]["run_id"]
    gpuctl("up", "--name", "b", "-y")
    second = json.loads(gpuctl("train", quick_project, "--cluster", "b", "--wait", "--json").stdout)["run"]["run_id"]
    one = json.loads(gpuctl("status", first[-4:], "--json").stdout)  # a unique suffix
    assert [r["run_id"] for r in one["runs"]] == [first] and [c["name"] for c in one["clusters"]] == ["a"]
    only_b = json.loads(gpuctl("status", "--cluster", "b", "--json").stdout)
    assert [r["run_id"] for r in only_b["runs"]] == [second] and [c["name"] for c in only_b["clusters"]] == ["b"]
    assert second in gpuctl("status", "--cluster", "b").stdout and first not in gpuctl("status", "--cluster", "b").stdout
    gpuctl("status", "nosuch-run", code=4)
    assert "no cluster named 'nosuch'" in gpuctl("status", "--cluster", "nosuch", code=4).stderr
    gpuctl("status", first, "--all", code=2)


def test_clusters_released_over_a_week_ago_are_hidden_unless_all(gpuctl, quick_project):
    """Plain `status` leaves out clusters released over a week ago (and their runs) and says how
    many; `status --all` shows everything (them too, then every provider's resources); a named
    cluster or run is shown however old; `cost` still counts every dollar."""
    import time

    from gpuctl.ops.session import open_session

    gpuctl("up", "--name", "old", "--usd-per-hour", "3.6", "-y")
    old_run = json.loads(gpuctl("train", quick_project, "--cluster", "old", "--wait", "--json").stdout)["run"]["run_id"]
    gpuctl("down", "old", "-y")
    gpuctl("up", "--name", "recent", "-y")
    gpuctl("down", "recent", "-y")
    gpuctl("up", "--name", "live", "-y")
    s = open_session()
    try:  # the ledger as it is eight days after `old` was released
        old = next(c for c in s.ledger.clusters() if c.name == "old")
        with s.ledger.write() as db:
            db.execute("UPDATE clusters SET terminated_at = ? WHERE id = ?", (time.time() - 8 * 86400, old.id))
    finally:
        s.close()
    plain = json.loads(gpuctl("status", "--json").stdout)
    assert [c["name"] for c in plain["clusters"]] == ["recent", "live"] and plain["hidden_clusters"] == 1
    assert old_run not in [r["run_id"] for r in plain["runs"]]
    text = gpuctl("status").stdout
    assert "1 cluster(s) released over a week ago not shown: `gpuctl status --all` shows them." in " ".join(text.split())
    assert not re.search(r"\bold\b", text)
    every = json.loads(gpuctl("status", "--all", "--json").stdout)
    assert [c["name"] for c in every["clusters"]] == ["old", "recent", "live"]
    assert old_run in [r["run_id"] for r in every["runs"]] and "resources" in every
    text = gpuctl("status", "--all").stdout
    assert re.search(r"\bold\b", text) and old_run in text and "not shown" not in text
    assert [c["name"] for c in json.loads(gpuctl("status", "--cluster", "old", "--json").stdout)["clusters"]] == ["old"]
    assert [r["run_id"] for r in json.loads(gpuctl("status", old_run, "--json").stdout)["runs"]] == [old_run]
    cost = json.loads(gpuctl("cost", "--json").stdout)
    assert "old" in [c["name"] for c in cost["clusters"]] and cost["total_usd"] > 0

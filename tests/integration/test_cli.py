"""Every command through Click's CliRunner, happy and error paths, on the real local provider
(real tmux, real files, real ledger). Training scripts here are quick ones that need no TF; the
real TF payload is covered in test_payload_tf.py and the README demo in e2e/.

Bad inputs tried: a missing project dir, a file instead of a dir, a project with no entry point,
malformed and unknown keys in the project's gpuctl.toml, an unknown env setting, a negative rate
(flag and env), a negative budget, `train` with no cluster, `train`/`down`/`logs` naming unknown
clusters or runs, `up` with a name in use and with a bad name, an unknown provider, `down`
without -y off a terminal, and a training script that crashes."""

import json
import time
from pathlib import Path

import pytest

from gpuctl.errors import ExitCode
from tests.waits import wait_for


def test_whole_loop_up_train_status_logs_cost_down(gpuctl, quick_project, isolated):
    out = gpuctl("up", "--usd-per-hour", "3.6", "-y").stdout
    assert "Cluster 'default' is up" in out
    res = gpuctl("train", quick_project, "--wait", "--", "--epochs", "3", "--name", "x y")
    assert "args: ['--epochs', '3', '--name', 'x y']" in res.stdout
    assert "done" in res.stdout
    assert "Pushed code: 1 of 1 files" in res.stderr

    status = json.loads(gpuctl("status", "--json").stdout)
    assert status["clusters"][0]["name"] == "default" and status["clusters"][0]["is_default"]
    (run,) = status["runs"]
    assert run["state"] == "succeeded" and run["epoch"] == 3 and run["epochs_planned"] == 3
    assert run["metrics"] == {"loss": 0.5}

    cost = json.loads(gpuctl("cost", "--json").stdout)
    assert cost["clusters"][0]["name"] == "default" and cost["clusters"][0]["usd"] > 0
    (rc,) = cost["runs"]
    assert rc["run_id"] == run["run_id"] and rc["cluster"] == "default" and rc["epochs_planned"] == 3
    assert [e["epoch"] for e in rc["epochs"]] == [1, 2, 3]
    for e in rc["epochs"]:
        assert e["seconds"] > 0 and e["examples_per_s"] > 0
        assert e["epoch_cost_usd"] == pytest.approx(e["seconds"] / 1000, rel=0.01)  # 3.6 $/h = $0.001/s
    assert rc["epochs"][-1]["cumulative_usd"] == pytest.approx(sum(e["epoch_cost_usd"] for e in rc["epochs"]))
    mean = sum(e["epoch_cost_usd"] for e in rc["epochs"]) / 3
    assert rc["projected_total_usd"] == pytest.approx(mean * 3)

    table = gpuctl("cost").stdout
    assert run["run_id"] in table and "projected total" in table
    only = json.loads(gpuctl("cost", run["run_id"], "--json").stdout)
    assert [r["run_id"] for r in only["runs"]] == [run["run_id"]]
    assert run["run_id"] in gpuctl("status").stdout
    assert "done" in gpuctl("logs").stdout
    assert "done" in gpuctl("logs", run["run_id"], "-f").stdout

    # A second push of the unchanged project copies nothing.
    second = gpuctl("train", quick_project, "--json")
    assert json.loads(second.stdout)["code_sync"]["files_copied"] == 0

    back = isolated.parent / "back"
    assert "Pulled" in gpuctl("pull", run["run_id"], "--dest", back).stdout
    assert (back / run["run_id"] / "epochs.jsonl").read_text().count("\n") == 3
    down = gpuctl("down", "-y").stdout
    assert "Cluster 'default' is down" in down
    assert not (isolated / "clusters" / "default").exists()
    # Reports and logs outlive the cluster.
    assert json.loads(gpuctl("cost", "--json").stdout)["runs"][0]["epochs"][2]["epoch"] == 3
    assert "done" in gpuctl("logs", run["run_id"]).stdout
    # The run's directory was kept under the home: pull still brings it back.
    assert "Pulled" in gpuctl("pull", run["run_id"], "--dest", back).stdout
    assert "which is down" in gpuctl("attach", run["run_id"], code=4).stderr
    assert "nothing to do" in gpuctl("down", "-y").stdout
    assert "already down" in gpuctl("down", "default", "-y").stdout


def test_logs_follow_streams_until_the_run_ends(gpuctl, make_project):
    proj = make_project("slow", {"train.py": "import time\nfor i in range(5):\n    print('tick', i, flush=True)\n    time.sleep(0.3)\n"})
    gpuctl("up")
    run_id = json.loads(gpuctl("train", proj, "--json").stdout)["run"]["run_id"]
    assert json.loads(gpuctl("status", "--json").stdout)["runs"][0]["state"] == "running"
    out = gpuctl("logs", "-f", run_id).stdout
    assert [line for line in out.splitlines() if line.startswith("tick")] == [f"tick {i}" for i in range(5)]
    assert json.loads(gpuctl("status", "--json").stdout)["runs"][0]["state"] == "succeeded"


def test_down_stops_running_jobs_and_keeps_their_record(gpuctl, make_project):
    proj = make_project("forever", {"train.py": "import time\nprint('started', flush=True)\ntime.sleep(600)\n"})
    gpuctl("up", "--name", "box")
    run_id = json.loads(gpuctl("train", proj, "--json").stdout)["run"]["run_id"]
    wait_for(lambda: "started" in gpuctl("logs", run_id).stdout, 60, "the job's first line")  # the launcher imports TF first
    out = gpuctl("down", "box", "-y").stdout
    assert "stopped 1 run(s)" in out
    runs = json.loads(gpuctl("status", "--json").stdout)["runs"]
    assert runs[0]["run_id"] == run_id and runs[0]["state"] == "stopped"
    assert "started" in gpuctl("logs", run_id).stdout


def test_config_show_names_each_source(gpuctl, isolated, monkeypatch):
    user = isolated.parent / "user" / ".config" / "gpuctl" / "settings.toml"
    user.parent.mkdir(parents=True)
    user.write_text("[local]\nusd_per_hour = 1.25\n")
    (isolated.parent / "work" / "gpuctl.toml").write_text("[train]\ntf_log_level = 1\n")
    monkeypatch.setenv("GPUCTL_TRAIN__ENTRY", "main.py")
    values = {v["key"]: v for v in json.loads(gpuctl("config", "show", "--json").stdout)}
    assert values["local.usd_per_hour"] == {"key": "local.usd_per_hour", "value": 1.25, "source": str(user)}
    assert values["train.tf_log_level"]["source"] == str(isolated.parent / "work" / "gpuctl.toml")
    assert values["train.entry"]["source"] == "env GPUCTL_TRAIN__ENTRY"
    assert values["provider"] == {"key": "provider", "value": "local", "source": "env GPUCTL_PROVIDER"}
    assert values["cluster"]["source"] == "default"
    assert "local.usd_per_hour" in gpuctl("config", "show").stdout


def test_several_clusters_and_the_default(gpuctl, quick_project):
    gpuctl("up", "--name", "a")
    gpuctl("up", "--name", "b")  # the newest is the default
    assert json.loads(gpuctl("train", quick_project, "--json").stdout)["run"]["cluster"] == "b"
    assert json.loads(gpuctl("train", quick_project, "--cluster", "a", "--json").stdout)["run"]["cluster"] == "a"
    gpuctl("down", "b", "-y")
    # No default now, and two... one live cluster left: it is picked.
    assert json.loads(gpuctl("train", quick_project, "--json").stdout)["run"]["cluster"] == "a"


def test_help_for_every_command(gpuctl):
    for cmd in (["--help"], ["up", "--help"], ["train", "--help"], ["status", "--help"], ["logs", "--help"],
                ["cost", "--help"], ["down", "--help"], ["config", "show", "--help"]):
        assert "Usage:" in gpuctl(*cmd).stdout


# --- bad inputs: one-line error, hint, documented exit code, nothing created or destroyed ------


def assert_one_line_error(result, code, needle):
    assert result.exit_code == code
    stderr = result.stderr
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("Error:")]
    assert len(errors) == 1 and needle in errors[0], result.stderr
    assert any(line.startswith("Hint:") for line in lines)
    assert "Traceback" not in stderr


def ledger_snapshot(gpuctl):
    status = json.loads(gpuctl("status", "--json").stdout)
    return status["clusters"], [(r["run_id"], r["state"]) for r in status["runs"]]


@pytest.mark.parametrize(
    "files, needle, code",
    [
        ({}, "no entry point", ExitCode.PROJECT),
        ({"main.py": "print(1)\n"}, "no entry point", ExitCode.PROJECT),
        ({"train.py": "", "gpuctl.toml": "[train\n"}, "malformed TOML", ExitCode.CONFIG),
        ({"train.py": "", "gpuctl.toml": "[train]\nentrypoint = 'x.py'\n"}, "unknown setting `train.entrypoint`", ExitCode.CONFIG),
        ({"train.py": "", "gpuctl.toml": "[guards]\nbudget_usd = -1\n"}, "guards.budget_usd = -1", ExitCode.CONFIG),
        ({"train.py": "", "gpuctl.toml": "[train]\nentry = 'gone.py'\n"}, "gone.py does not exist", ExitCode.PROJECT),
    ],
)
def test_bad_projects_are_refused_before_anything_starts(gpuctl, make_project, isolated, files, needle, code):
    gpuctl("up")
    before = ledger_snapshot(gpuctl)
    proj = make_project("bad", files)
    assert_one_line_error(gpuctl("train", proj, code=code), code, needle)
    assert ledger_snapshot(gpuctl)[1] == before[1] == []
    assert not (isolated / "clusters" / "default" / "code").exists()


def test_missing_project_and_file_as_project(gpuctl, tmp_path):
    gpuctl("up")
    assert_one_line_error(gpuctl("train", tmp_path / "nope", code=6), 6, "does not exist")
    f = tmp_path / "file.py"
    f.write_text("")
    assert_one_line_error(gpuctl("train", f, code=6), 6, "is not a directory")


def test_train_with_no_cluster_creates_nothing(gpuctl, quick_project, isolated):
    assert_one_line_error(gpuctl("train", quick_project, code=5), 5, "no cluster is up")
    assert_one_line_error(gpuctl("train", quick_project, "--cluster", "ghost", code=4), 4, "no cluster named 'ghost'")
    assert not (isolated / "clusters").exists()


def test_unknown_names(gpuctl):
    assert_one_line_error(gpuctl("logs", "no-such-run", code=4), 4, "no run named 'no-such-run'")
    assert_one_line_error(gpuctl("logs", code=4), 4, "no run yet")
    assert_one_line_error(gpuctl("cost", "no-such-run", code=4), 4, "no run named 'no-such-run'")
    assert_one_line_error(gpuctl("down", "ghost", "-y", code=4), 4, "no cluster named 'ghost'")


def test_up_refuses_a_name_in_use_and_bad_values(gpuctl, monkeypatch):
    gpuctl("up", "--name", "one")
    before = ledger_snapshot(gpuctl)
    assert_one_line_error(gpuctl("up", "--name", "one", code=5), 5, "already up")
    assert_one_line_error(gpuctl("up", "--name", "bad name!", code=3), 3, "cluster")
    assert_one_line_error(gpuctl("up", "--name", "two", "--usd-per-hour", "-2", code=3), 3, "--usd-per-hour -2.0")
    assert_one_line_error(gpuctl("up", "--name", "two", "--provider", "gcp", code=3), 3, "unknown provider")
    monkeypatch.setenv("GPUCTL_LOCAL__USD_PER_HOUR", "-1")
    assert_one_line_error(gpuctl("up", "--name", "two", code=3), 3, "env GPUCTL_LOCAL__USD_PER_HOUR")
    monkeypatch.setenv("GPUCTL_LOCAL__USD_PER_HOURS", "1")
    assert_one_line_error(gpuctl("config", "show", code=3), 3, "unknown setting `local.usd_per_hours`")
    monkeypatch.delenv("GPUCTL_LOCAL__USD_PER_HOUR")
    monkeypatch.delenv("GPUCTL_LOCAL__USD_PER_HOURS")
    assert [c["name"] for c in ledger_snapshot(gpuctl)[0]] == [c["name"] for c in before[0]] == ["one"]


def test_negative_budget_flag(gpuctl, quick_project):
    gpuctl("up")
    assert_one_line_error(gpuctl("train", quick_project, "--budget", "-3", code=3), 3, "train.budget_usd = -3.0")
    assert ledger_snapshot(gpuctl)[1] == []


def test_destroying_needs_confirmation_off_a_terminal(gpuctl):
    gpuctl("up")
    assert_one_line_error(gpuctl("down", code=2), 2, "without confirmation")
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"][0]["state"] == "up"
    assert_one_line_error(gpuctl("up", "--name", "paid", "--usd-per-hour", "2", code=2), 2, "without confirmation")


def test_the_local_launch_question_has_the_aws_shape_with_its_dollars(gpuctl):
    # The price, the hard cap in dollars and the budget, as on aws.
    err = gpuctl("up", "--name", "paid", "--nodes", "2", "--usd-per-hour", "1.5", code=2).stderr
    assert ("start local cluster 'paid' (2 nodes) at $3.0000/h (2 nodes at $1.5000/h each, local.usd_per_hour), "
            "billed until `gpuctl down` or the 8 h hard cap (8 h x $3.0000/h = $24.00)") in err
    assert ledger_snapshot(gpuctl)[0] == []


def test_crashing_script_shows_failed_with_the_tail_of_its_log(gpuctl, make_project):
    proj = make_project("crash", {"train.py": "print('loading data', flush=True)\nraise ValueError('shapes do not match')\n"})
    gpuctl("up")
    res = gpuctl("train", proj, "--wait", code=8)
    assert_one_line_error(res, 8, "failed (exit code 1)")
    assert "ValueError: shapes do not match" in res.stdout  # the streamed log
    status = json.loads(gpuctl("status", "--json").stdout)
    (run,) = status["runs"]
    assert run["state"] == "failed" and run["exit_code"] == 1
    assert run["log_tail"].splitlines()[-1] == "ValueError: shapes do not match"
    # The user's traceback, without the launcher's frames.
    assert "gpuctl_run.py" not in run["log_tail"] and "runpy" not in run["log_tail"]
    table = gpuctl("status").stdout
    assert "failed (1)" in table and "ValueError: shapes do not match" in table


def test_error_text_is_not_eaten_as_markup(gpuctl, isolated, monkeypatch):
    user = isolated.parent / "user.toml"  # aws settings are the user's: a project's gpuctl.toml may not set them
    user.write_text("[aws]\nregion = 'us-east-1'\nimage = 'ami-1'\nssh_cidr = 'nope'\n")
    monkeypatch.setenv("GPUCTL_CONFIG", str(user))
    res = gpuctl("config", "show", code=3)
    assert "aws.ssh_cidr = 'nope'" in res.stderr and "[aws]" not in res.stdout


def test_debug_shows_the_traceback(gpuctl):
    res = gpuctl("--debug", "logs", "nope", code=4)
    assert "Traceback" in res.stderr and "Error: no run named 'nope'" in res.stderr


def test_a_reused_name_keeps_each_clusters_own_dollars(gpuctl):
    """A `down` then `up` of the same name at another price used to show the second
    cluster's dollars on both rows and count them twice."""
    gpuctl("up", "--usd-per-hour", "36", "-y")
    time.sleep(1.0)
    gpuctl("down", "-y")
    gpuctl("up", "--usd-per-hour", "3600", "-y")
    time.sleep(1.0)
    gpuctl("down", "-y")
    report = json.loads(gpuctl("cost", "--json").stdout)
    first, second = report["clusters"]
    assert first["name"] == second["name"] == "default" and first["id"] != second["id"]
    assert first["usd_per_hour"] == 36 and second["usd_per_hour"] == 3600
    # Each row is its own uptime times its own rate.
    for c in (first, second):
        assert c["usd"] == pytest.approx(c["uptime_s"] * c["usd_per_hour"] / 3600, rel=1e-6)
    assert second["usd"] > 50 * first["usd"]
    assert report["total_usd"] == pytest.approx(first["usd"] + second["usd"])
    status = json.loads(gpuctl("status", "--json").stdout)
    assert [c["usd"] for c in status["clusters"]] == pytest.approx([first["usd"], second["usd"]])


def test_a_finished_run_stops_costing(gpuctl, quick_project, isolated):
    """A run that ended while nobody looked kept costing until gpuctl looked; it ends
    when its job ended on the instance."""
    gpuctl("up", "--usd-per-hour", "3600", "-y")
    t0 = time.time()
    run_id = json.loads(gpuctl("train", quick_project, "--json").stdout)["run"]["run_id"]
    exitcode = next(isolated.glob(f"clusters/*/runs/{run_id}")) / "exitcode"
    wait_for(exitcode.exists, 60, "the job's exit code")  # watched on disk, not through gpuctl, which would record the end
    ended = time.time()
    time.sleep(2.0)
    (run,) = json.loads(gpuctl("status", "--json").stdout)["runs"]
    assert run["state"] == "succeeded"
    assert run["elapsed_s"] <= ended - t0 + 0.5  # not the 2 s waited since
    assert run["usd"] == pytest.approx(run["elapsed_s"], rel=1e-6)  # $1 a second
    time.sleep(0.5)
    assert json.loads(gpuctl("status", "--json").stdout)["runs"][0]["elapsed_s"] == run["elapsed_s"]


def test_a_broken_settings_file_does_not_break_an_existing_cluster(gpuctl, quick_project, isolated):
    """Status, cost, logs and down work from what the ledger recorded at `up`."""
    gpuctl("up")
    gpuctl("train", quick_project, "--wait")
    Path("gpuctl.toml").write_text("[guards]\nidle = 'five parsecs'\n")
    gpuctl("status")
    gpuctl("cost")
    assert "done" in gpuctl("logs").stdout
    gpuctl("down", "-y")
    assert "gpuctl.toml" in gpuctl("config", "show", code=3).stderr
    Path("gpuctl.toml").write_text("this is [not toml\n")
    gpuctl("status")
    assert "malformed TOML" in gpuctl("up", code=3).stderr


def test_an_up_that_created_nothing_leaves_no_row(gpuctl, monkeypatch):
    """Every failed `up` used to leave a "down" cluster in `status`. Tried: an ssh host
    that refuses connections, an unknown provider, a bad name, a negative price."""
    monkeypatch.setenv("GPUCTL_REMOTE__CONNECT_TIMEOUT_S", "2")
    gpuctl("up", "--provider", "ssh", "--host", "root@127.0.0.1:9", code=7)
    gpuctl("up", "--provider", "nowhere", code=3)
    gpuctl("up", "--name", "bad name!", code=3)
    gpuctl("up", "--usd-per-hour", "-1", code=3)
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []


def test_infinite_and_huge_numbers_are_refused_wherever_they_come_from(gpuctl, quick_project, monkeypatch):
    """A price of inf from the environment was stored as null and broke every later command; a
    budget of inf broke `status`. Tried: inf, nan and 1e308 through env, file and flags."""
    monkeypatch.setenv("GPUCTL_LOCAL__USD_PER_HOUR", "inf")
    assert "local.usd_per_hour" in gpuctl("up", "-y", code=3).stderr
    monkeypatch.setenv("GPUCTL_LOCAL__USD_PER_HOUR", "nan")
    gpuctl("up", "-y", code=3)
    monkeypatch.delenv("GPUCTL_LOCAL__USD_PER_HOUR")
    Path("settings.toml").write_text("[local]\nusd_per_hour = inf\n")
    monkeypatch.setenv("GPUCTL_CONFIG", "settings.toml")
    gpuctl("up", "-y", code=3)
    monkeypatch.delenv("GPUCTL_CONFIG")
    assert json.loads(gpuctl("status", "--json").stdout)["clusters"] == []
    gpuctl("up")
    for budget in ("inf", "nan", "1e308"):
        gpuctl("train", quick_project, "--budget", budget, code=3)
    gpuctl("status")  # still answers


def test_attach_off_a_terminal_and_a_plot_that_is_not_a_png(gpuctl, quick_project, tmp_path):
    gpuctl("up")
    gpuctl("train", quick_project)
    assert "needs a terminal" in gpuctl("attach", code=3).stderr
    assert "tmux" in gpuctl("attach", "--print").stdout
    assert ".png" in gpuctl("cost", "--plot", tmp_path / "cost.txt", code=3).stderr
    assert not (tmp_path / "cost.txt").exists()


def test_a_mistyped_provider_gets_a_did_you_mean(gpuctl, monkeypatch):
    out = gpuctl("up", "--provider", "locl", "-y", code=3)
    assert "unknown provider 'locl'; did you mean 'local'?" in out.stderr
    monkeypatch.setenv("GPUCTL_PROVIDER", "locl")  # the setting, not the flag
    out = gpuctl("up", "-y", code=3)
    assert "did you mean 'local'?" in out.stderr


@pytest.mark.parametrize("answer", [b"n\n", b"\x04"])  # "n", and Ctrl-D (end of input) at the question
def test_answering_no_to_a_prompt_says_nothing_done_and_exits_11(gpuctl, answer):
    gpuctl("up")
    # The prompt is only asked on a terminal: a real pty on stdin, the real gpuctl process.
    import os
    import subprocess
    import sys

    master, slave = os.openpty()
    try:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "gpuctl"), "down"], stdin=slave,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        os.write(master, answer)
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(slave)
        os.close(master)
    assert proc.returncode == 11, (out, err)  # ExitCode.DECLINED: told apart from an internal error
    assert "Nothing done." in out
    assert "default" in gpuctl("status").stdout  # still up


def test_cost_on_an_empty_home_says_how_to_start(gpuctl):
    out = gpuctl("cost").stdout
    assert "No runs yet. Start one with: gpuctl up, then gpuctl train PROJECT" in out
    report = json.loads(gpuctl("cost", "--json").stdout)
    assert report["clusters"] == [] and report["runs"] == []


def test_a_run_is_named_by_a_unique_prefix_or_suffix_of_its_id(gpuctl, make_project):
    import os.path

    proj = make_project("hi", {"train.py": "print('hello from', 'the job', flush=True)\n"})
    gpuctl("up")
    a = json.loads(gpuctl("train", proj, "--wait", "--json").stdout)["run"]["run_id"]
    b = json.loads(gpuctl("train", proj, "--wait", "--json").stdout)["run"]["run_id"]
    assert "hello from the job" in gpuctl("logs", a[:-1]).stdout  # a prefix
    suffix = next(a[-n:] for n in range(1, len(a) + 1) if not b.endswith(a[-n:]) and not b.startswith(a[-n:]))
    assert [r["run_id"] for r in json.loads(gpuctl("cost", suffix, "--json").stdout)["runs"]] == [a]
    common = os.path.commonprefix([a, b])
    if common:
        out = gpuctl("logs", common, code=ExitCode.CONFLICT)
        assert a in out.stderr and b in out.stderr and "\n" not in out.stderr.split("Hint:")[0].strip()
    out = gpuctl("logs", "", code=ExitCode.NOT_FOUND)
    assert "gpuctl status" in out.stderr
    out = gpuctl("logs", "nosuchrun", code=ExitCode.NOT_FOUND)
    assert "no run named 'nosuchrun'" in out.stderr and "gpuctl status" in out.stderr

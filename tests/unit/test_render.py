"""The CLI's rendering (gpuctl.cli.render, render_cost, render_commands) from result models built here,
on consoles of fixed width; the pipe behaviour of the real `gpuctl` executable; children's exit codes.

Bad inputs tried: 36-character run ids and dollar values from $0.0123 to $11,111.10 at widths 200,
80, 60 and 40 (where nothing fits: stacked); values holding rich markup (`[bold]`, `[aws]`); a
metric word wider than its column; a stderr that raises on write; output into a pipe closed before
gpuctl writes (help, version, reports, CSV, an error into `2>&1`); a child binary that does not
exist; a child killed by a signal; exec hosts exiting 127 and by signal under --json.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from gpuctl.cli import render
from gpuctl.cli.render import Col, fit, usd
from gpuctl.cli.render import commands as render_commands
from gpuctl.cli.render import cost as render_cost
from gpuctl.model.records import ClusterRecord, InstanceRecord, Resource, SettingValue
from gpuctl.model.results import (
    ClusterCost,
    ClusterStatus,
    CostReport,
    EpochRow,
    ExecResult,
    GuardReport,
    Inventory,
    RunCost,
    RunStatus,
    StatusReport,
    UpResult,
)
from gpuctl.model.specs import AwsSpec

IDS = ["cifar10-resnet-20261130-142233-ab12", "cifar10-resnet-20261130-153012-cd34", "digits-mlp-20261201-080000-0e0f"]
CLUSTER = "lab-gpu-box-a100"
WIDTHS = [200, 80, 60]
MONEY_TOKEN = re.compile(r"\$[0-9][0-9,.]*")
WHOLE_MONEY = re.compile(r"\$(\d\.\d{4}|\d{1,3}(,\d{3})*\.\d{2})")
GPUCTL = Path(sys.executable).with_name("gpuctl")


def draw(fn, width, *args, **kwargs) -> str:
    buf = io.StringIO()
    fn(*args, out=Console(file=buf, width=width, highlight=False, color_system=None), **kwargs)
    return buf.getvalue()


def assert_whole(text: str, width: int, ids=(), money=()) -> None:
    """Every id and money string appears whole; no money is ever cut; nothing is ellipsized."""
    assert "…" not in text and "..." not in text, text
    for rid in ids:
        assert rid in text, (rid, text)
    for m in money:
        assert m in text, (m, text)
    for token in MONEY_TOKEN.findall(text):
        assert WHOLE_MONEY.fullmatch(token.rstrip(".,;")), (token, text)
    for line in text.splitlines():
        assert len(line.rstrip()) <= width, (width, line)


def epoch_rows(n: int, each: float) -> tuple[EpochRow, ...]:
    return tuple(EpochRow(epoch=i, seconds=61.5, examples=50000, examples_per_s=813.0, epoch_cost_usd=each,
                          cumulative_usd=each * i, metrics={"loss": 0.4321, "val_accuracy": 0.9876, "lr": 1e-3})
                 for i in range(1, n + 1))


def cost_report() -> CostReport:
    runs = tuple(
        RunCost(run_id=rid, cluster=CLUSTER, state="running", instance_type="g5.xlarge", market="spot",
                usd_per_hour=1234.56 if k == 0 else 0.0123, epochs_done=3, epochs_planned=30,
                epochs=epoch_rows(3, 1234.56 if k == 0 else 0.0123), mean_epoch_s=61.5, mean_epoch_usd=0.0123,
                spent_usd=1234.56, projected_remaining_usd=9876.54, projected_total_usd=11111.10,
                examples_per_s=813.0, usd_per_million_examples=0.0123, projected_finish_at=1.8e9,
                tensorflow="2.21.0", image="Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20261101 "
                "(ami-0123456789abcdef0)")
        for k, rid in enumerate(IDS))
    clusters = (ClusterCost(name=CLUSTER, provider="aws", state="up", uptime_s=172800, usd_per_hour=1.006,
                            usd=1234.56, compute_usd=1200.0, storage_usd=34.56, spot_savings_usd=987.65,
                            idle_usd=0.0123),)
    return CostReport(clusters=clusters, runs=runs, total_usd=1234.56)


def status_report() -> StatusReport:
    guard = {"fires_at": {"idle": 2e9, "hard-cap": 2e9 + 60}, "stalled": ["[bold]job[/bold]"]}
    clusters = (ClusterStatus(name=CLUSTER, provider="aws", state="up", uptime_s=3600, usd_per_hour=0.0123,
                              usd=1234.56, is_default=True, instances=1, guard=guard, note="spot [interruption]"),)
    runs = tuple(RunStatus(run_id=rid, cluster=CLUSTER, state="failed" if k else "running", exit_code=1 if k else None,
                           epoch=3, epochs_planned=30, metrics={"loss": 0.4321, "val_accuracy": 0.9876},
                           elapsed_s=4000, usd=0.0123 if k else 1234.56,
                           log_tail="[red]ValueError[/red]: shapes" if k else None, tensorflow="2.21.0",
                           image="Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) (ami-0fedcba9876543210)")
                 for k, rid in enumerate(IDS))
    return StatusReport(clusters=clusters, runs=runs)


# --- the width rule ---------------------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
def test_cost_keeps_ids_and_money_whole(width):
    text = draw(render_cost.cost, width, cost_report(), detailed=True)
    assert_whole(text, width, IDS + [CLUSTER], ["$1,234.56", "$11,111.10", "$0.0123", "$3,703.68", "$0.0369"])
    assert text.rstrip().endswith("Total across clusters: $1,234.56")
    if width == 200:
        assert "hidden" not in text and "$987.65" in text and "$34.56" in text
    else:  # columns go in the documented order, money and ids stay
        assert "hidden to fit" in text and "provider" in text


def test_cost_drops_low_value_columns_first():
    text = draw(render_cost.cost, 80, cost_report(), detailed=False)
    header = next(line for line in text.splitlines() if line.startswith("cluster"))
    for gone in ("provider", "state", "$ spot saved"):
        assert gone not in header
    assert "$ compute" in header and "$ idle" in header


@pytest.mark.parametrize("width", WIDTHS)
def test_compare_keeps_ids_and_money_whole(width):
    text = draw(render_cost.compare, width, cost_report())
    assert_whole(text, width, IDS, ["$11,111.10", "$0.0123"])
    side_by_side = text.splitlines()[0].split() == IDS
    assert side_by_side == (width == 200)  # narrower: one row per run
    if side_by_side:  # each run's TensorFlow and image (its id: the name is long)
        assert "2.21.0" in text and "ami-0123456789abcdef0" in text and "Ubuntu" not in text


@pytest.mark.parametrize("width", WIDTHS)
def test_status_keeps_ids_and_money_whole_and_markup_literal(width):
    text = draw(render_cost.status, width, status_report(), now=2e9 - 90)
    assert_whole(text, width, IDS + [CLUSTER + " *"], ["$1,234.56", "$0.0123"])
    assert "failed (1)" in text and "idle in 1m30s" in text
    if width == 200:  # each run's TensorFlow and image id, while they fit
        assert "2.21.0" in text and "ami-0fedcba9876543210" in text
    # Values are text, never markup: the brackets print as they are.
    assert "[red]ValueError[/red]: shapes" in text and "[bold]job[/bold]" in text and "spot [interruption]" in text


@pytest.mark.parametrize("width", WIDTHS)
def test_inventory_keeps_ids_whole(width):
    ids = ["i-0123456789abcdef0", "sg-0fedcba9876543210", "gpuctl-lab-gpu-box-a100-key"]
    inv = Inventory(resources=tuple(Resource(provider="aws", kind=k, id=i, region="ap-southeast-2",
                                             cluster=CLUSTER if n else "orphan-[x]", state="running")
                                    for n, (k, i) in enumerate(zip(["instance", "security-group", "key-pair"], ids))),
                    ledger_clusters=(CLUSTER,))
    text = draw(render_commands.inventory, width, inv)
    assert_whole(text, width, ids + [CLUSTER, "orphan-[x]"])
    assert "NO" in text and "yes" in text


@pytest.mark.parametrize("width", WIDTHS + [40])
def test_config_show_keeps_keys_values_and_sources_whole(width, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.chdir(tmp_path)
    values = [SettingValue(key="aws.image_pattern", value="Deep Learning*AMI GPU TensorFlow*", source="default"),
              SettingValue(key="aws.region", value="[aws] region", source="/home/someone/.config/gpuctl/settings.toml"),
              SettingValue(key="train.entry", value="main.py", source=str(tmp_path / "gpuctl.toml")),
              SettingValue(key="ssh.hosts", value=["gpu@lab-box-1:2222", "gpu@lab-box-2"], source="env GPUCTL_SSH__HOSTS")]
    text = draw(render_commands.config_values, width, values)
    shown = ["~/.config/gpuctl/settings.toml", "gpuctl.toml", "GPUCTL_SSH__HOSTS", "[aws]"]
    assert_whole(text, width, [v.key for v in values] + [w for v in values for w in json.dumps(v.value).split()] + shown)
    stacked = not text.startswith("setting")
    assert stacked == (width <= 60)


@pytest.mark.parametrize("width", WIDTHS)
def test_guard_table(width):
    report = GuardReport(cluster=CLUSTER, config={"idle_s": 1800, "budget_usd": 1234.56, "hard_cap_at": 2e9,
                                                  "on_fire": "poweroff", "poweroff_command": "sudo shutdown -h now"},
                         state={"fires_at": {"idle": 2e9 - 60}, "spent_usd": 0.0123,
                                "fired": {"reason": "budget", "at": 2e9, "detail": "[spent]", "action": "poweroff"}})
    text = draw(render_commands.guard, width, report, now=2e9 - 120)
    assert_whole(text, width, [CLUSTER], ["$1,234.56", "$0.0123"])
    assert "fires in 1m00s" in text and "30m" in text and "FIRED: budget" in text and "[spent]" in text


def test_fit_wraps_free_text_at_spaces_then_drops_in_order_then_stacks():
    cols = [Col("id"), Col("a", drop=2), Col("b", drop=1), Col("notes", wrap=True, drop=3)]
    rows = [("run-123456", "aaaa", "bbbb", "one two three")]
    assert fit(cols, rows, 100) == ([0, 1, 2, 3], [10, 4, 4, 13])
    keep, widths = fit(cols, rows, 30)  # 10+4+4 + 6 of gaps leaves 6: "three" fits, the words wrap
    assert keep == [0, 1, 2, 3] and widths[3] == 6
    assert fit(cols, rows, 25)[0] == [0, 1, 3]  # b goes before a
    assert fit(cols, rows, 18)[0] == [0, 3]
    assert fit(cols, rows, 9) is None  # the id alone is wider: stack
    assert fit([Col("x")], [], 5) == ([0], [1])


def test_columns_line_up_with_wide_characters():
    from rich.cells import cell_len

    buf = io.StringIO()
    render.table(Console(file=buf, width=80), [Col("run"), Col("note"), Col("$", True)],
                 [("r-1", "精度 ok", "$0.0123"), ("r-2", "plain", "$1,234.56")])
    lines = buf.getvalue().splitlines()
    assert {cell_len(line) for line in lines} == {cell_len(lines[0])}  # right-aligned money ends together
    assert lines[1].endswith("$0.0123") and lines[2].endswith("$1,234.56")


def test_stacked_layout_shows_every_value():
    buf = io.StringIO()
    render.table(Console(file=buf, width=20), [Col("run"), Col("$ spent", drop=1)], [(IDS[0], "$1,234.56")])
    assert buf.getvalue().splitlines() == [IDS[0], "  $ spent  $1,234.56"]


def test_money_and_durations():
    assert [usd(v) for v in (None, 0.0123, 9.99994, 1234.56, 11111.1)] == ["-", "$0.0123", "$9.9999", "$1,234.56",
                                                                           "$11,111.10"]
    assert [render.duration(s) for s in (None, 4.26, 42, 62, 3725)] == ["-", "4.3s", "42s", "1m02s", "1h02m"]


# --- CSV, JSON, plain outputs -------------------------------------------------------------------


def test_csv_has_one_row_per_epoch():
    buf = io.StringIO()
    render_cost.cost_csv(cost_report(), buf)
    rows = buf.getvalue().splitlines()
    assert rows[0].split(",") == render_cost.CSV_COLUMNS and len(rows) == 1 + 9
    assert rows[1].startswith(f"{IDS[0]},{CLUSTER},g5.xlarge,spot,1,61.500,50000,813.000,1234.560000,1234.560000")


def test_json_of_a_model_and_of_a_list(capsys):
    render.emit_json(cost_report())
    assert json.loads(capsys.readouterr().out)["runs"][0]["run_id"] == IDS[0]
    render.emit_json([ExecResult(host="h", returncode=127, stdout="", stderr="")])
    assert json.loads(capsys.readouterr().out) == [{"host": "h", "returncode": 127, "stdout": "", "stderr": ""}]


def test_up_names_the_hard_cap_from_the_spec(capsys):
    spec = AwsSpec(name="c", max_hours=6.5)
    cluster = ClusterRecord(id=1, name="c", provider="aws", state="up", created_at=0, spec=spec)
    inst = InstanceRecord(id="i-0123456789abcdef0", cluster="c", state="running", launched_at=0, workdir="/w",
                          region="us-east-1", usd_per_hour=0.0123)
    render_commands.up(UpResult(cluster=cluster, instances=(inst,)))
    out = capsys.readouterr().out
    assert "i-0123456789abcdef0" in out and "$0.0123/h" in out and "6.5 h after boot" in out


def test_recent_runs_agree():
    from gpuctl.cli import clusters as cli_clusters

    assert cli_clusters.RECENT_RUNS == render_cost.RECENT_RUNS


# --- the progress sink ----------------------------------------------------------------------------


def test_progress_off_a_terminal_prints_finished_lines_and_some_live_ones():
    buf = io.StringIO()
    with render.Progress(buf, tty=False) as progress:
        progress("image ami-1")
        progress("waiting for SSH (1s)...")
        progress("waiting for SSH (2s)...")  # within LIVE_EVERY_S of the last live line: skipped
        progress("SSH works")
        progress("watchdog: installing…")  # a new step's first live line shows
    assert buf.getvalue().splitlines() == ["  image ami-1", "  waiting for SSH (1s)...", "  SSH works",
                                           "  watchdog: installing…"]


def test_progress_on_a_terminal_replaces_live_and_same_step_lines_and_keeps_the_rest():
    erase = "\r\x1b[K"
    buf = io.StringIO()
    with render.Progress(buf, tty=True) as progress:
        progress("waiting for SSH (3s)...")
        progress("waiting for SSH (6s)...")
        progress("SSH works: ubuntu@203.0.113.9")
        progress("code: 120 files, 3 MB")
        progress("code: 300 files, 9 MB, done")
        progress("watchdog: armed")
        progress("starting...")
    assert buf.getvalue() == (
        f"  waiting for SSH (3s)...{erase}  waiting for SSH (6s)...{erase}  SSH works: ubuntu@203.0.113.9\n"
        f"  code: 120 files, 3 MB{erase}  code: 300 files, 9 MB, done\n  watchdog: armed\n  starting...{erase}")


def test_progress_keeps_a_line_too_long_to_erase_whole():
    buf = io.StringIO()  # not a real terminal: 80 columns assumed
    with render.Progress(buf, tty=True) as progress:
        progress("image: " + "x" * 100)
        progress("image: short")
    assert buf.getvalue() == "  image: " + "x" * 100 + "\n  image: short\n"


def test_progress_never_breaks_the_command_when_stderr_is_gone():
    class Closed(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    progress = render.Progress(Closed(), tty=False)
    progress("launched i-1")
    progress("more")
    progress.close()
    assert progress.broken


# --- children's exit codes ------------------------------------------------------------------------


def test_a_missing_child_binary_is_gpuctls_remote_error_not_127():
    from gpuctl.cli.common import run_child
    from gpuctl.errors import ExitCode, RemoteError

    with pytest.raises(RemoteError) as err:
        run_child(["/nonexistent/ssh", "host"])
    assert err.value.exit_code == ExitCode.REMOTE and "/nonexistent/ssh" in err.value.message
    assert run_child(["sh", "-c", "exit 3"]) == 3
    assert run_child(["sh", "-c", "kill -TERM $$"]) == 128 + 15


@pytest.mark.parametrize("as_json", [[], ["--json"]])
def test_exec_exits_with_the_worst_host_status(monkeypatch, as_json):
    import gpuctl.cli.runs
    import gpuctl.ops.runs
    from gpuctl.cli import cli

    results = [ExecResult(host="a", returncode=0, stdout="ok\n", stderr=""),
               ExecResult(host="b", returncode=127, stdout="", stderr="sh: nvidia-smi: not found\n")]
    monkeypatch.setattr(gpuctl.cli.runs, "session", lambda ctx, **flags: None)
    monkeypatch.setattr(gpuctl.ops.runs, "exec_command", lambda s, command, cluster=None: results)
    res = CliRunner().invoke(cli, ["exec", *as_json, "--", "nvidia-smi"])
    assert res.exit_code == 127, res.output
    results[1] = results[1].model_copy(update={"returncode": -9})  # killed by SIGKILL
    assert CliRunner().invoke(cli, ["exec", *as_json, "--", "nvidia-smi"]).exit_code == 137


def test_help_texts_name_the_real_defaults():
    from gpuctl.cli import cli

    assert "default provider: aws" in CliRunner().invoke(cli, ["--help"]).output
    up_help = " ".join(CliRunner().invoke(cli, ["up", "--help"]).output.split())
    assert "aws, ssh or local" in up_help and "default aws" in up_help


# --- output into a closed pipe: the real executable -----------------------------------------------


def gpuctl_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCTL_")}
    return dict(env, GPUCTL_HOME=str(tmp_path / "home"), GPUCTL_PROVIDER="local", HOME=str(tmp_path))


def into_closed_pipe(args: list[str], tmp_path: Path, stderr_too: bool = False) -> subprocess.CompletedProcess:
    """Run gpuctl with stdout on a pipe whose reader is already gone: every write fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([str(GPUCTL), *args], stdout=write, stderr=write if stderr_too else subprocess.PIPE,
                              env=gpuctl_env(tmp_path), cwd=tmp_path, timeout=60)
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["up", "--help"], ["config", "show"], ["status"],
                                  ["cost"], ["cost", "--csv"], ["cost", "--json"], ["status", "--all"]])
def test_a_closed_pipe_ends_gpuctl_quietly_with_141(args, tmp_path):
    proc = into_closed_pipe(args, tmp_path)
    assert proc.stderr == b"" and proc.returncode == 141, proc.stderr.decode()


def test_an_error_into_a_closed_pipe_is_still_141(tmp_path):
    assert into_closed_pipe(["logs", "no-such-run"], tmp_path, stderr_too=True).returncode == 141
    assert into_closed_pipe(["up", "--no-such-flag"], tmp_path, stderr_too=True).returncode == 141


@pytest.mark.parametrize("command", ["--help", "config show", "cost --csv", "cost", "status", "guard show"])
def test_piping_into_head_prints_no_error(command, gpuctl, tmp_path):
    # The cluster made in this process, in the test's own home (whose clean-up then ends its
    # watchdog and tmux server); only the command piped into head is the real executable.
    gpuctl("up", "-y")
    script = f"set -o pipefail; {GPUCTL} {command} | head -1"
    proc = subprocess.run(["bash", "-c", script], env=dict(os.environ), cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.stderr == "" and proc.returncode in (0, 141), proc.stderr
    assert len(proc.stdout.splitlines()) == 1


def test_clusters_sharing_a_name_stay_apart_at_80_columns():
    """Every `up` is its own cluster: a name used again shows with its id, which no column drop hides."""
    rows = tuple(ClusterCost(id=i, name="default", provider="local", state="down", uptime_s=60.0 * i,
                             usd_per_hour=rate, usd=rate / 60 * i) for i, rate in ((1, 36.0), (2, 3600.0)))
    text = draw(render_cost.cost, 80, CostReport(clusters=rows, runs=(), total_usd=sum(r.usd for r in rows)), False)
    assert_whole(text, 80, ids=["default#1", "default#2"], money=[usd(0.6), usd(120.0)])


def test_guard_show_says_which_logins_hold_the_idle_guard_off():
    state = {"logins": {"utmp": "/run/utmp", "counted": [{"user": "root", "line": "pts/0", "host": "10.0.0.1"}],
                        "ignored": [{"why": "tmux pane"}, {"why": "tmux pane"}, {"why": "process gone"}]}}
    report = GuardReport(cluster="c", config={"idle_s": 1800, "on_fire": "stop-jobs"}, state=state)
    text = draw(render_commands.guard, 80, report)
    assert "logins: root@pts/0 from 10.0.0.1 (not counted: 1 process gone, 2 tmux pane)" in text


def test_what_a_failed_up_leaves_running_is_two_lines_with_the_most_it_may_bill():
    def inst(iid, node=0, **kw):
        return InstanceRecord(id=iid, node=node, cluster="gpu", launched_at=1.0, workdir="/w", **{"state": "running", **kw})

    spot = {"instance_type": "g5.xlarge", "market": "spot", "usd_per_hour": 0.00001, "max_usd_per_hour": 1.006}
    assert render_commands.still_running([inst("i-1", **spot)]) == [
        "Still running: i-1 (g5.xlarge spot: $0.0000/h now, up to $1.0060/h)", "End it with: gpuctl down gpu -y"]
    many = [inst(f"i-{n}", n, **spot) for n in (4, 0, 1, 2, 3)]
    assert render_commands.still_running(many)[0] == (
        "Still running: i-0, i-1, i-2, i-3 and 1 more (5 x g5.xlarge spot: $0.0001/h now, up to $5.0300/h in all)")
    on_demand = {"instance_type": "g5.xlarge", "market": "on-demand", "usd_per_hour": 1.006, "max_usd_per_hour": 1.006}
    assert render_commands.still_running([inst("i-1", **on_demand)])[0] == "Still running: i-1 (g5.xlarge on-demand: $1.0060/h)"
    # A machine gpuctl did not rent (local, ssh): no type; no price set, nothing said billed.
    assert render_commands.still_running([inst("local-gpu-1")]) == [
        "Still up: local-gpu-1", "End it with: gpuctl down gpu -y"]
    assert render_commands.still_running([inst("ssh:me@box", usd_per_hour=2.0)])[0] == "Still running: ssh:me@box ($2.0000/h)"
    # Ended (a zone's nodes given up): nothing to say.
    assert render_commands.still_running([inst("i-1", state="terminated", **spot)]) == []


def test_the_fast_paths_of_cells_and_widths_say_what_the_long_ways_say():
    """cell(), width_of() and _whole() skip clean, rich's cell_len and textwrap where those would
    change nothing (issue 39: most of `status`'s table at 5,000 runs): over awkward strings they
    agree with the long ways."""
    import random
    import textwrap

    from rich.cells import cell_len

    from gpuctl.cli.render import _whole, cell, width_of
    from gpuctl.model.untrusted import clean

    rnd = random.Random(39)
    alphabet = "ab =.-  \t\n\r\x1b[\x7f\x85\x9b\u00a0\u2003\u202e\u200b界😀é"
    for _ in range(20_000):
        text = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 24)))
        assert cell(text) == clean(text).replace("\n", " ").replace("\t", " ")
        one = cell(text)
        assert width_of(one) == cell_len(one)
        width = rnd.randint(1, 30)
        if _whole(one, width):
            assert textwrap.wrap(one, width, break_long_words=False, break_on_hyphens=False) == [one]

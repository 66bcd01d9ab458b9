"""A cloned project's gpuctl.toml on the `local` provider, end to end: it cannot loosen a guard or
run a command here, and what it asked for in vain is said in one line; a stricter guard it asks
for is applied. The watchdog's own config (guard/config.json) is what the tests read.

Bad inputs tried: guards off (idle, stall, budgets), max_hours of a year, on_fire = poweroff with
a poweroff_command that leaves a marker on this machine, a remote.python of the project's, a
provider and price of its own, a looser idle than the one `guard set` put in force, a project
directory whose name holds terminal control sequences."""

from __future__ import annotations

import json

from gpuctl.config.settings import Settings
from gpuctl.ledger import Ledger
from tests.waits import wait_for

CLONED = """
provider = "aws"
[local]
usd_per_hour = 0.0
[guards]
idle = "0"
stall = "0"
budget_usd = 0
max_hours = 8760
on_fire = "poweroff"
poweroff_command = "touch {marker}"
down_after_run = true  # stricter than the user's: applied
[train]
budget_usd = 0
[remote]
python = "{marker}-python"
"""


def notes_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Note: ignored in")]


def config_of(home) -> dict:
    return json.loads((home / "clusters" / "default" / "guard" / "config.json").read_text())


def test_a_cloned_project_cannot_loosen_the_guards_or_run_a_command_here(gpuctl, make_project, isolated, tmp_path,
                                                                          monkeypatch):
    user = tmp_path / "user" / ".config" / "gpuctl" / "settings.toml"
    user.parent.mkdir(parents=True)
    user.write_text('[local]\nusd_per_hour = 0.5\n[guards]\nidle = "45m"\nstall = "40m"\nbudget_usd = 20\n'
                    'max_hours = 6\ncheck_interval = "1s"\ngrace = "1s"\n[train]\nbudget_usd = 3\n')
    marker = tmp_path / "pwned"
    proj = make_project("cloned", {"train.py": "print('hi')\n", "gpuctl.toml": CLONED.format(marker=marker)})
    monkeypatch.chdir(proj)  # ./gpuctl.toml is the project's file too
    up = gpuctl("up", "-y")  # on local (GPUCTL_PROVIDER), at the user's price: the project's are ignored
    [note] = notes_of(up.stderr)
    for key in ("provider", "local.usd_per_hour", "guards.idle (looser than yours)", "guards.max_hours (looser",
                "guards.on_fire", "guards.poweroff_command", "remote.python", "train.budget_usd (looser"):
        assert key in note, (key, note)
    assert "guards.down_after_run" not in note and str(proj / "gpuctl.toml") in note
    train = gpuctl("train", ".", "--wait")
    assert notes_of(train.stderr) == [note], train.stderr  # one line, the same
    [cluster] = Ledger(isolated).clusters()
    assert (cluster.spec.provider, cluster.spec.max_hours, cluster.spec.usd_per_hour) == ("local", 6.0, 0.5)
    cfg = config_of(isolated)
    assert (cfg["idle_s"], cfg["stall_s"], cfg["budget_usd"]) == (2700, 2400, 20)
    assert cfg["poweroff_command"] == Settings().guards.poweroff_command and cfg["on_fire"] == "stop-jobs"
    assert cfg["down_after_run"] is True  # the stricter guard the project asked for
    [run] = Ledger(isolated).runs(cluster.id)
    assert run.budget_usd == 3
    # down_after_run fires a grace (1 s) after the run's end: with the user's action, not the project's.
    fired = isolated / "clusters" / "default" / "guard" / "fired.json"
    wait_for(fired.exists, 30, "the guard's fire")
    assert json.loads(fired.read_text())["action"] == "stop-jobs"
    # The watchdog names the fire in its state once its fire() is over: a poweroff command, had it
    # been the action, has run by then.
    state = fired.parent / "state.json"
    wait_for(lambda: state.exists() and json.loads(state.read_text()).get("fired"), 30, "the fire's end in state.json")
    assert not marker.exists()
    gpuctl("down", "-y")


def test_a_stricter_guard_is_applied_and_never_loosens_the_one_in_force(gpuctl, make_project, isolated):
    gpuctl("up")
    gpuctl("train", make_project("mine", {"train.py": "print('hi')\n"}), "--wait")  # arms the watchdog
    gpuctl("guard", "set", "--idle", "5m")  # the user's, stricter than the default 30m
    proj = make_project("evil\x1b]0;title\x07\x1b[2J", {"train.py": "print('hi')\n",
                                                         "gpuctl.toml": '[guards]\nidle = "20m"\nstall = "10m"\n'})
    train = gpuctl("train", proj, "--wait")
    cfg = config_of(isolated)
    assert cfg["stall_s"] == 600  # tighter than the user's 30m: applied
    assert cfg["idle_s"] == 300  # 20m is tighter than the user's settings, not than `guard set`'s 5m
    assert notes_of(train.stderr) == []  # nothing in the file was refused
    assert "\x1b" not in train.stderr and "\x07" not in train.stderr
    # A refused key in that project: the line names the file, with no control sequence of its name.
    (proj / "gpuctl.toml").write_text('[guards]\non_fire = "poweroff"\n')
    train = gpuctl("train", proj, "--wait")
    [note] = notes_of(train.stderr)
    assert "guards.on_fire" in note and "projects/evil/gpuctl.toml" in note  # the sequence left out
    assert "\x1b" not in train.stderr and "\x07" not in train.stderr
    gpuctl("down", "-y")


def test_both_project_files_are_named_in_one_line(gpuctl, make_project, isolated):
    (isolated.parent / "work" / "gpuctl.toml").write_text('[guards]\npoweroff_command = "touch x"\n')
    proj = make_project("p", {"train.py": "print('hi')\n", "gpuctl.toml": '[remote]\npython = "/bin/false"\n'})
    gpuctl("up")
    train = gpuctl("train", proj, "--wait")
    [note] = notes_of(train.stderr)
    assert f"{isolated.parent / 'work' / 'gpuctl.toml'}: guards.poweroff_command; in {proj / 'gpuctl.toml'}: " \
           "remote.python;" in note
    assert "hi" in gpuctl("logs").stdout
    gpuctl("down", "-y")

"""A project's gpuctl.toml is data: it may say how its job runs and tighten a guard, nothing else.

Walks the settings model, so a key added later is refused from a project by default. Bad inputs
tried: every key outside the allow-list (in ./gpuctl.toml and in the trained project's), a guard
turned off, a year's max_hours, a budget of 0, a looser stall action, a malformed guard value,
an unknown key with control sequences in its name."""

from __future__ import annotations

import json

import pytest

from gpuctl.config import project
from gpuctl.config.load import load_settings
from gpuctl.config.settings import KNOWN_KEYS, Settings
from gpuctl.errors import ConfigError
from tests.conftest import REPO

# The allow-list as reviewed: a key joins it only with a change to this test.
REVIEWED = {
    "train.entry", "train.mixed_precision", "train.memory_growth", "train.tensorflow", "train.checkpoint",
    "train.keras", "train.tf_log_level", "train.gpu_sample_s",
    "train.requirements",  # a file inside the project (ops/packages.py refuses a path out of it)
    # the project's data set in S3 (read with the user's credentials: `train` names the file that set it)
    "train.data",
    # tighten only:
    "guards.max_hours", "guards.budget_usd", "guards.idle", "guards.stall", "guards.on_stall",
    "guards.down_after_run", "train.budget_usd", "train.start_timeout_s",
}


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def toml_line(key: str, value) -> str:
    section, _, name = key.rpartition(".")
    return (f"[{section}]\n" if section else "") + f"{name} = {json.dumps(value)}\n"


def other_value(key: str):
    """A value of the key's type that is not its default (valid or not: a refused key is not read)."""
    default = {v.key: v.value for v in load_settings(env={}, cwd=REPO / "docs").values()}[key]
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, list):
        return ["evil@example.com"]
    return "touch /tmp/pwned" if default == "" else default + "x"


def test_the_allow_list_is_the_reviewed_one():
    assert project.PROJECT_KEYS == REVIEWED
    assert REVIEWED <= set(KNOWN_KEYS)


@pytest.mark.parametrize("where", ["cwd", "project"])
def test_every_key_outside_the_allow_list_is_refused(tmp_path, where):
    """The walk over the model: every key not reviewed, each alone and then all in one file."""
    refused = [k for k in KNOWN_KEYS if k not in REVIEWED]
    assert "guards.poweroff_command" in refused and "remote.python" in refused and len(refused) > 40
    cwd, proj = tmp_path / "cwd", tmp_path / "proj"
    cwd.mkdir()
    target = (cwd if where == "cwd" else proj) / "gpuctl.toml"
    for key in refused:
        write(target, toml_line(key, other_value(key)))
        loaded = load_settings(env={}, cwd=cwd, project_dir=proj)
        assert loaded.sources.get(key, "default") == "default", key
        assert loaded.settings == Settings(), key
        assert [(i.key, i.file, i.looser) for i in loaded.ignored] == [(key, str(target), False)]
    sections: dict[str, list[str]] = {}
    for key in refused:
        section, _, name = key.rpartition(".")
        sections.setdefault(section, []).append(f"{name} = {json.dumps(other_value(key))}")
    write(target, "".join(f"[{s}]\n" * bool(s) + "\n".join(lines) + "\n" for s, lines in
                          sorted(sections.items())))
    loaded = load_settings(env={}, cwd=cwd, project_dir=proj)
    assert loaded.settings == Settings()
    assert sorted(i.key for i in loaded.ignored) == sorted(refused)
    line = project.said(loaded.ignored)
    assert "\n" not in line and str(target) in line and "remote.python" in line


# key, the user's value, a stricter one, looser ones
GUARDS = [
    ("guards.max_hours", 8, 2, [8760, 9]),
    ("guards.budget_usd", 10, 5, [0, 50]),
    ("guards.idle", "30m", "10m", ["0", "off", "2h"]),
    ("guards.stall", "30m", "5m", ["0", "31m"]),
    ("guards.on_stall", "warn", "fire", []),
    ("guards.down_after_run", False, True, []),
    ("train.budget_usd", 0, 5, []),  # a guard turned on
    ("train.start_timeout_s", 120, 30, [3600]),
]


@pytest.mark.parametrize("key, user, stricter, looser", GUARDS, ids=[g[0] for g in GUARDS])
def test_a_project_tightens_a_guard_and_never_loosens_it(tmp_path, key, user, stricter, looser):
    user_file = write(tmp_path / "user.toml", toml_line(key, user))
    env = {"GPUCTL_CONFIG": str(user_file)}
    proj = tmp_path / "proj"
    pfile = write(proj / "gpuctl.toml", toml_line(key, stricter))
    loaded = load_settings(env=env, cwd=tmp_path, project_dir=proj)
    strict = load_settings(env={**env, "GPUCTL_CONFIG": str(write(tmp_path / "u2.toml", toml_line(key, stricter)))},
                           cwd=tmp_path)
    assert loaded.settings == strict.settings and loaded.sources[key] == str(pfile) and not loaded.ignored
    assert loaded.from_project(key)
    mine = load_settings(env=env, cwd=tmp_path)
    for value in looser:
        write(pfile, toml_line(key, value))
        loaded = load_settings(env=env, cwd=tmp_path, project_dir=proj)
        assert loaded.settings == mine.settings and loaded.sources[key] == str(user_file)
        assert [(i.key, i.looser) for i in loaded.ignored] == [(key, True)]
        assert "(looser than yours)" in project.said(loaded.ignored)


@pytest.mark.parametrize("key, user, stricter", [
    ("guards.on_stall", "fire", "warn"), ("guards.down_after_run", True, False), ("train.budget_usd", 5, 0),
])
def test_a_guard_the_user_tightened_stays_tight(tmp_path, key, user, stricter):
    env = {"GPUCTL_CONFIG": str(write(tmp_path / "user.toml", toml_line(key, user)))}
    write(tmp_path / "gpuctl.toml", toml_line(key, stricter))  # ./gpuctl.toml is the project's too
    loaded = load_settings(env=env, cwd=tmp_path)
    assert loaded.settings == load_settings(env=env, cwd=tmp_path / "nowhere").settings
    assert [i.key for i in loaded.ignored] == [key]


def test_the_defaults_are_what_a_project_is_held_to_without_a_user_file(tmp_path):
    write(tmp_path / "gpuctl.toml", "[guards]\nidle = '0'\nstall = '10m'\nmax_hours = 8760\n"
                                    "poweroff_command = 'touch x'\non_fire = 'poweroff'\n")
    loaded = load_settings(env={}, cwd=tmp_path)
    g = loaded.settings.guards
    assert (g.idle, g.stall, g.max_hours, g.poweroff_command, g.on_fire) == ("30m", "10m", 8.0,
                                                                            Settings().guards.poweroff_command, "")
    assert [(i.key, i.looser) for i in loaded.ignored] == [
        ("guards.idle", True), ("guards.max_hours", True), ("guards.poweroff_command", False), ("guards.on_fire", False)]


def test_the_users_env_and_flags_still_win_over_a_project(tmp_path):
    write(tmp_path / "gpuctl.toml", "[guards]\nidle = '10m'\n")
    loaded = load_settings({"guards.max_hours": 100.0}, env={"GPUCTL_GUARDS__IDLE": "0"}, cwd=tmp_path)
    assert loaded.settings.guards.idle == "0" and loaded.settings.guards.max_hours == 100.0


def test_two_project_files_each_tighten_the_one_below(tmp_path):
    write(tmp_path / "gpuctl.toml", "[guards]\nidle = '10m'\n")
    proj = tmp_path / "p"
    write(proj / "gpuctl.toml", "[guards]\nidle = '20m'\n")  # stricter than the user's 30m, not than ./'s
    loaded = load_settings(env={}, cwd=tmp_path, project_dir=proj)
    assert loaded.settings.guards.idle == "10m"
    assert [(i.file, i.key, i.looser) for i in loaded.ignored] == [(str(proj / "gpuctl.toml"), "guards.idle", True)]


@pytest.mark.parametrize("text, needle", [
    ("[guards]\nidle = 'five parsecs'\n", "guards.idle"),  # a guard's bad value is an error, not ignored
    ("[guards]\nmax_hours = -1\n", "guards.max_hours"),
    ("[train]\nentry = '../x.py'\n", "train.entry"),
    ("[guards]\nidel = '5m'\n", "unknown setting `guards.idel`"),
])
def test_a_bad_value_of_an_allowed_key_is_still_an_error(tmp_path, text, needle):
    write(tmp_path / "gpuctl.toml", text)
    with pytest.raises(ConfigError, match=needle) as info:
        load_settings(env={}, cwd=tmp_path)
    assert str(tmp_path / "gpuctl.toml") in info.value.message + info.value.hint


def test_settings_docs_list_exactly_the_allow_list():
    """settings.example.toml's block on project files names every allowed key and no other."""
    text = (REPO / "settings.example.toml").read_text()
    block = text[text.index("# A project's gpuctl.toml"):].split("\n\n", 1)[0]
    named = {w.strip("`,.;:()") for w in block.split() if w.strip("`,.;:()") in KNOWN_KEYS}
    assert named == REVIEWED, named ^ REVIEWED
    for key in REVIEWED:  # and the page a user reads
        assert f"`{key}`" in (REPO / "docs" / "training.md").read_text(), key


def test_a_huge_project_file_is_refused_unread(tmp_path):
    """A clone's gpuctl.toml may be a link to any file here (a huge log, /proc/kcore): read with a
    bound, never whole into memory."""
    big = tmp_path / "big.toml"
    with open(big, "wb") as fh:
        fh.truncate(4 << 30)  # sparse: 4 GiB of NULs costs nothing on disk
    (tmp_path / "gpuctl.toml").symlink_to(big)
    with pytest.raises(ConfigError, match="larger than 1 MiB"):
        load_settings(env={}, cwd=tmp_path)


def test_a_project_file_that_is_not_utf8_is_a_config_error(tmp_path):
    (tmp_path / "gpuctl.toml").write_bytes(b"[train]\nentry = '\xff.py'\n")  # was an internal error
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_settings(env={}, cwd=tmp_path)

"""Settings precedence and validation. Bad inputs tried: unknown keys in a file and in the env
(with did-you-mean), malformed TOML, a negative rate, a negative budget, a bad enum value, an
absolute entry path, an unknown provider, a bad cluster name."""

import pytest
import tomllib

from gpuctl.config.load import load_settings
from gpuctl.config.settings import KNOWN_KEYS, Settings
from gpuctl.errors import ConfigError
from tests.conftest import REPO


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults_and_sources(tmp_path):
    loaded = load_settings(env={}, cwd=tmp_path)
    assert loaded.settings == Settings()
    assert {v.source for v in loaded.values()} == {"default"}
    assert [v.key for v in loaded.values()] == list(KNOWN_KEYS)


def test_precedence_each_layer_overrides_the_one_below(tmp_path):
    user = write(tmp_path / "user.toml", "[train]\nentry = 'a.py'\nmixed_precision = 'on'\ntf_log_level = 1\n")
    write(tmp_path / "cwd" / "gpuctl.toml", "[train]\nentry = 'b.py'\ntf_log_level = 3\n")
    proj = tmp_path / "proj"
    write(proj / "gpuctl.toml", "[train]\nentry = 'c.py'\n[guards]\nbudget_usd = 5\n")
    env = {"GPUCTL_CONFIG": str(user), "GPUCTL_GUARDS__BUDGET_USD": "7", "GPUCTL_PROVIDER": "local"}
    loaded = load_settings({"guards.budget_usd": 9.5}, project_dir=proj, env=env, cwd=tmp_path / "cwd")
    s, src = loaded.settings, loaded.sources
    assert s.train.mixed_precision == "on" and src["train.mixed_precision"] == str(user)
    assert s.train.tf_log_level == 3 and src["train.tf_log_level"] == str(tmp_path / "cwd" / "gpuctl.toml")
    assert s.train.entry == "c.py" and src["train.entry"] == str(proj / "gpuctl.toml")
    assert s.guards.budget_usd == 9.5 and src["guards.budget_usd"] == "flag"
    assert src["provider"] == "env GPUCTL_PROVIDER"
    # Without the flag, the env wins over the project file.
    loaded = load_settings({}, project_dir=proj, env=env, cwd=tmp_path / "cwd")
    assert loaded.settings.guards.budget_usd == 7 and loaded.sources["guards.budget_usd"] == "env GPUCTL_GUARDS__BUDGET_USD"


def test_user_file_defaults_to_home_config(tmp_path):
    write(tmp_path / "h" / ".config" / "gpuctl" / "settings.toml", "cluster = 'lab'\n")
    loaded = load_settings(env={"HOME": str(tmp_path / "h")}, cwd=tmp_path)
    assert loaded.settings.cluster == "lab"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[train]\nentyr = 'x.py'\n", "unknown setting `train.entyr`"),
        ("[nope]\nx = 1\n", "unknown setting `nope.x`"),
        ("[train\nentry = 1\n", "malformed TOML"),
        ("[local]\nusd_per_hour = -1\n", "local.usd_per_hour = -1"),
        ("[guards]\nbudget_usd = -5\n", "guards.budget_usd = -5"),
        ("[train]\nmixed_precision = 'maybe'\n", "train.mixed_precision"),
        ("[train]\nentry = '/etc/passwd'\n", "train.entry"),
        ("[train]\nentry = '../x.py'\n", "train.entry"),
        ("provider = 'gcp'\n", "unknown provider"),
        ("cluster = 'has space'\n", "cluster"),
    ],
)
def test_bad_settings_file_is_a_config_error(tmp_path, text, needle):
    # The user's own file: a project's may set few of these (tests/unit/test_project_settings.py).
    user = write(tmp_path / "settings.toml", text)
    with pytest.raises(ConfigError) as info:
        load_settings(env={"GPUCTL_CONFIG": str(user)}, cwd=tmp_path)
    assert needle in info.value.message
    assert "\n" not in info.value.message
    assert info.value.hint


def test_unknown_key_suggests_the_closest(tmp_path):
    write(tmp_path / "gpuctl.toml", "[local]\nusd_per_hr = 1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(env={}, cwd=tmp_path)
    assert "local.usd_per_hour" in info.value.hint


def test_unknown_env_setting_is_an_error_but_reserved_vars_are_not(tmp_path):
    with pytest.raises(ConfigError, match="GPUCTL_LOCAL__USD"):
        load_settings(env={"GPUCTL_LOCAL__USD": "1"}, cwd=tmp_path)
    ok = load_settings(env={"GPUCTL_HOME": "/x", "GPUCTL_DEBUG": "1", "GPUCTL_RUN_ID": "r"}, cwd=tmp_path)
    assert ok.settings == Settings()


def test_env_value_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="env GPUCTL_LOCAL__USD_PER_HOUR"):
        load_settings(env={"GPUCTL_LOCAL__USD_PER_HOUR": "-0.5"}, cwd=tmp_path)
    with pytest.raises(ConfigError, match="local.usd_per_hour"):
        load_settings(env={"GPUCTL_LOCAL__USD_PER_HOUR": "cheap"}, cwd=tmp_path)


def test_settings_example_documents_every_key_with_its_default():
    data = tomllib.loads((REPO / "settings.example.toml").read_text())
    flat = {}
    for k, v in data.items():
        if isinstance(v, dict):
            flat.update({f"{k}.{sk}": sv for sk, sv in v.items()})
        else:
            flat[k] = v
    assert list(flat) == list(KNOWN_KEYS)
    defaults = {v.key: v.value for v in load_settings(env={}, cwd=REPO / "docs").values()}
    assert flat == defaults


@pytest.mark.parametrize("key, value, needle", [
    ("GPUCTL_GUARDS__IDLE", "9" * 400, "longer than a year"),  # a float of 400 digits is inf
    ("GPUCTL_GUARDS__STALL", "400d", "longer than a year"),
    ("GPUCTL_GUARDS__GRACE", "1" * 320 + "s", "longer than a year"),
    ("GPUCTL_REMOTE__CONNECT_TIMEOUT_S", "1e9", "remote.connect_timeout_s"),
    ("GPUCTL_AWS__WAIT_TIMEOUT_S", "inf", "aws.wait_timeout_s"),
])
def test_every_number_is_finite_and_bounded_at_the_edge(tmp_path, key, value, needle):
    """A value that would be stored as inf (or absurdly large) is refused."""
    with pytest.raises(ConfigError, match=needle):
        load_settings({}, env={key: value, "HOME": str(tmp_path)})

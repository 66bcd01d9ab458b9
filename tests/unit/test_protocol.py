"""payloads/gpuctl_protocol.py: the files the client writes and the payloads read. What the
client builds comes back the same through the file; what an older or newer client (or a broken
file) gives the payload never crashes it: a missing or bad value takes the default."""

from __future__ import annotations

import json

import pytest

from gpuctl.payloads.gpuctl_protocol import GuardConfig, QueueConfig, RunConfig, StoreConfig


def test_a_run_config_goes_through_its_file_unchanged(tmp_path):
    sent = RunConfig(run_id="r1", entry="train.py", usd_per_hour=1.5, stop_after_epochs=3, report_path="/r/e.jsonl",
                     store=StoreConfig(target={"bucket": "b"}, key_prefix="p/", read_only=True),
                     queue=QueueConfig(dir="/q", want=2, slots=4, gpus=4, node_usd_per_hour=6.0))
    path = tmp_path / "run.json"
    path.write_text(sent.to_json())
    assert RunConfig.load(str(path)) == sent
    # The keys on disk are the ones gpuctl has always written (running instances read them), and
    # the run's own code and data copies (issue 37), which a payload before them ignores.
    assert {"run_id", "entry", "usd_per_hour", "budget_usd", "mixed_precision", "memory_growth", "gpu_sample_s",
            "stop_after_epochs", "report_path", "checkpoint_dir", "notice_file", "store", "resumed",
            "queue", "code_dir", "data_dir", "code_hash"} == set(json.loads(path.read_text()))


def test_a_guard_config_goes_through_its_file_unchanged(tmp_path):
    sent = GuardConfig(idle_s=600.0, on_fire="poweroff", hard_cap_at=2e9, notice={"endpoint": "http://x"},
                       cluster_key="1-abc")
    path = tmp_path / "config.json"
    path.write_text(sent.to_json())
    assert GuardConfig.load(str(path)) == sent


@pytest.mark.parametrize("data", [None, [], "x", {}, {"grace_s": None}])
def test_nothing_usable_reads_as_the_defaults(data):
    assert GuardConfig.from_dict(data) == GuardConfig()


def test_a_missing_or_broken_file_reads_as_the_defaults(tmp_path):
    assert RunConfig.load(str(tmp_path / "absent.json")) == RunConfig()
    (tmp_path / "bad.json").write_text("{not json")
    assert RunConfig.load(str(tmp_path / "bad.json")) == RunConfig()
    (tmp_path / "deep.json").write_text("[" * 100_000)
    assert GuardConfig.load(str(tmp_path / "deep.json")) == GuardConfig()


@pytest.mark.parametrize("key, value", [
    ("grace_s", "soon"), ("grace_s", float("nan")), ("grace_s", True), ("grace_s", [1]),
    ("on_fire", "explode"), ("on_stall", 1), ("down_after_run", "yes"), ("poweroff_command", None),
    ("notice", "http://x"), ("tmux_socket", 7),
])
def test_a_bad_guard_value_takes_its_default_and_the_rest_stands(key, value):
    got = GuardConfig.from_dict({key: value, "idle_s": 600})
    assert getattr(got, key) == getattr(GuardConfig(), key) and got.idle_s == 600.0


@pytest.mark.parametrize("value", ["later", float("inf"), True, [1]])
def test_a_deadline_that_is_there_but_unreadable_fires_rather_than_never(value):
    """A hard cap (or a run-done mark) the watchdog cannot read is taken as passed long ago: the
    spend ends, as it did before the protocol; a missing one is off."""
    from gpuctl.payloads import gpuctl_decide

    got = GuardConfig.from_dict({"hard_cap_at": value, "down_after_run_since": value})
    assert got.hard_cap_at == 1.0 and got.down_after_run_since == 0.0
    assert gpuctl_decide.hard_cap(got, now=1e9) == (1.0, "max_hours reached")  # the watchdog's own rule fires
    assert GuardConfig.from_dict({}).hard_cap_at is None and GuardConfig.from_dict({"hard_cap_at": None}).hard_cap_at is None
    assert gpuctl_decide.hard_cap(GuardConfig.from_dict({}), now=1e9) == (None, None)


def test_one_protocol_module_whichever_name_imports_it(monkeypatch):
    """The client's gpuctl.payloads.gpuctl_protocol is the payloads' bare gpuctl_protocol: a config
    the client built passes the payloads' isinstance checks (two copies would be two classes)."""
    import gpuctl_protocol

    from gpuctl.payloads import gpuctl_decide, gpuctl_protocol as client_side, gpuctl_report

    assert gpuctl_protocol is client_side
    assert gpuctl_decide.config(client_side.GuardConfig(idle_s=600.0)).idle_s == 600.0
    monkeypatch.delenv("GPUCTL_RUN_DIR", raising=False)
    assert gpuctl_report.run_config() == {}  # off gpuctl, as before the protocol


def test_numbers_may_come_as_ints_or_numeric_text():
    assert GuardConfig.from_dict({"grace_s": 30, "budget_usd": "2.5"}).grace_s == 30.0
    assert GuardConfig.from_dict({"budget_usd": "2.5"}).budget_usd == 2.5


def test_unknown_keys_are_ignored_and_nested_records_are_lenient_too():
    got = RunConfig.from_dict({"run_id": "r", "from_a_newer_client": 1, "stop_after_epochs": 0,
                               "queue": {"want": 0, "slots": "x", "gpus": 2.5, "dir": "/q", "extra": 1},
                               "store": "s3://not-a-dict", "mixed_precision": "sometimes"})
    assert got.run_id == "r" and got.stop_after_epochs is None and got.store is None
    assert got.mixed_precision == "auto"
    assert got.queue == QueueConfig(dir="/q")  # want 0 and slots "x" out of bounds, 2.5 GPUs no integer


def test_the_payload_sees_the_defaults_the_settings_start_from():
    from gpuctl.config.settings import GuardSettings, parse_duration

    g = GuardSettings()
    assert parse_duration(g.grace) == GuardConfig.grace_s
    assert parse_duration(g.check_interval) == GuardConfig.check_interval_s
    assert (g.gpu_idle_percent, g.poweroff_command) == (GuardConfig.gpu_idle_percent, GuardConfig.poweroff_command)

"""Timing knobs are settings that reach the instance's processes: tests set them
short through the environment, as a user sets them in settings.toml, instead of patching
constants that a watchdog on another machine never sees."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuctl.config.load import load_settings
from gpuctl.errors import ConfigError
from gpuctl.provision.aws.provider import AwsProvider


def test_the_imds_poll_reaches_the_watchdogs_notice_config(tmp_path):
    loaded = load_settings(env={"GPUCTL_AWS__IMDS_POLL_S": "1", "GPUCTL_AWS__MARKET": "spot"}, cwd=tmp_path)
    assert loaded.sources["aws.imds_poll_s"] == "env GPUCTL_AWS__IMDS_POLL_S"
    spec = AwsProvider.spec_from_settings(loaded.settings)
    assert spec.imds_poll_s == 1.0
    assert AwsProvider(Path(tmp_path), spec).interruption_notice() == {"endpoint": "http://169.254.169.254",
                                                                       "interval_s": 1.0}
    default = AwsProvider.spec_from_settings(load_settings(env={}, cwd=tmp_path).settings)
    assert AwsProvider(Path(tmp_path), default).interruption_notice()["interval_s"] == 5.0


@pytest.mark.parametrize("value", ["0", "0.1", "61", "nan", "soon"])
def test_an_imds_poll_out_of_bounds_is_refused(tmp_path, value):
    with pytest.raises(ConfigError) as err:
        load_settings(env={"GPUCTL_AWS__IMDS_POLL_S": value}, cwd=tmp_path)
    assert "aws.imds_poll_s" in err.value.message

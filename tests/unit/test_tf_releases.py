"""The dated list of TensorFlow releases `up --tf` is checked against."""

import pytest

from gpuctl.config import tf_releases
from gpuctl.config.settings import TESTED_TENSORFLOW
from gpuctl.errors import ConfigError


@pytest.mark.parametrize("version", [TESTED_TENSORFLOW, "2.21.0", "2.12", "2.19.1", "2.21.1", "2.22"])
def test_releases_and_the_next_minor_pass(version):
    tf_releases.check(version)


@pytest.mark.parametrize("version", ["9.99", "1.0", "3.0", "2.23", "2.11.0"])
def test_what_was_never_released_is_refused_naming_the_lists_date(version):
    with pytest.raises(ConfigError) as err:
        tf_releases.check(version)
    assert f"--tf {version}: no such TensorFlow release" in err.value.message
    assert tf_releases.LIST_DATE in err.value.message

"""`config show`: every setting, its value and where the value came from."""

from __future__ import annotations

from gpuctl.model.records import SettingValue
from gpuctl.ops.session import Session


def show(s: Session) -> list[SettingValue]:
    """Every setting with its source; a broken settings file raises ConfigError naming it."""
    return s.settings().values()

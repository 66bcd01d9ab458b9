"""Settings from layered sources, each value remembering where it came from.

Precedence, lowest first: defaults < user file (`$GPUCTL_CONFIG`, else
`~/.config/gpuctl/settings.toml`) < `./gpuctl.toml` < the trained project's `gpuctl.toml` <
`GPUCTL_*` env (`GPUCTL_<SECTION>__<KEY>`) < command-line flags. The two gpuctl.toml files are the
project's: they give only what gpuctl/config/project.py allows (a guard only tighter than below).
Unknown keys are errors everywhere: a typo must never silently fall back to a default.
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, ValidationError

from gpuctl.config import project
from gpuctl.config.project import Ignored
from gpuctl.config.settings import KNOWN_KEYS, Settings
from gpuctl.errors import ConfigError
from gpuctl.model.records import SettingValue

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]  # installed on 3.10 only

ENV_PREFIX = "GPUCTL_"
# Env vars gpuctl itself reads or sets for jobs; they are not settings.
RESERVED_ENV = {"HOME", "CONFIG", "DEBUG", "RUN_ID", "RUN_DIR", "OUTPUT_DIR", "REPORT_PATH"}
PROJECT_FILE = "gpuctl.toml"


class LoadedSettings(BaseModel):
    """Validated settings plus, for every dotted key, the source of its value."""

    model_config = ConfigDict(frozen=True, defer_build=True)

    settings: Settings
    sources: dict[str, str]
    project_files: tuple[str, ...] = ()  # the project's gpuctl.toml files this load looked at
    ignored: tuple[Ignored, ...] = ()  # what they asked for and did not get

    def from_project(self, key: str) -> bool:
        """Whether the value of `key` is a project's (a guard it tightened, or how its job runs)."""
        return self.sources.get(key) in self.project_files

    def values(self) -> list[SettingValue]:
        data = self.settings.model_dump()
        out = []
        for key in KNOWN_KEYS:
            value: Any = data
            for part in key.split("."):
                value = value[part]
            out.append(SettingValue(key=key, value=value, source=self.sources.get(key, "default")))
        return out


def user_config_path(env: Mapping[str, str]) -> Path:
    if env.get("GPUCTL_CONFIG"):
        return Path(env["GPUCTL_CONFIG"])
    return Path(env.get("HOME", str(Path.home()))) / ".config" / "gpuctl" / "settings.toml"


def _unknown(key: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(KNOWN_KEYS), n=1)
    hint = f"Did you mean `{close[0]}`?" if close else "See settings.example.toml for every key."
    return ConfigError(f"unknown setting `{key}` in {source}", hint)


def _flatten_file(data: dict[str, Any], source: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            for sub, subval in value.items():
                flat[f"{key}.{sub}"] = subval
        else:
            flat[key] = value
    for key in flat:
        if key not in KNOWN_KEYS:
            raise _unknown(key, source)
    return flat


MAX_FILE = 1 << 20  # bytes: a project's gpuctl.toml may be a link to any file here (a huge log)


def read_toml(path: Path) -> dict[str, Any]:
    """Parse one TOML file; a syntax error becomes a ConfigError naming file and line."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_FILE + 1)
        if len(raw) > MAX_FILE:
            raise ConfigError(f"{path} is larger than {MAX_FILE >> 20} MiB: not a settings file",
                              "Check the file (or the link) of that name.")
        data: dict[str, Any] = tomllib.loads(raw.decode("utf-8"))
        return data
    except UnicodeDecodeError:
        raise ConfigError(f"malformed TOML in {path}: not UTF-8", "Fix the file; TOML syntax: https://toml.io") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"malformed TOML in {path}: {exc}", "Fix the file; TOML syntax: https://toml.io") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}", "Check the path and its permissions.") from None


def _env_layer(env: Mapping[str, str]) -> dict[str, str]:
    flat: dict[str, str] = {}
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        rest = var[len(ENV_PREFIX) :]
        if rest in RESERVED_ENV or rest.startswith("TEST_"):
            continue
        key = rest.lower().replace("__", ".")
        if key not in KNOWN_KEYS:
            raise _unknown(key, f"environment variable {var}")
        flat[key] = value
    return flat


def load_settings(
    flags: Mapping[str, Any] | None = None,
    project_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> LoadedSettings:
    """Merge every layer, validate, and return the settings with each value's source. The
    project's files (./gpuctl.toml, the project's own) give only what gpuctl/config/project.py
    allows; what they asked for in vain is in `ignored`."""
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    files = [cwd / PROJECT_FILE]
    if project_dir is not None and (project_dir / PROJECT_FILE).resolve() != (cwd / PROJECT_FILE).resolve():
        files.append(project_dir / PROJECT_FILE)
    layers: list[tuple[str, bool, dict[str, Any]]] = []
    for path, of_project in [(user_config_path(env), False)] + [(f, True) for f in files]:
        if path.is_file():
            layers.append((str(path), of_project, _flatten_file(read_toml(path), str(path))))
    layers.append(("env", False, _env_layer(env)))
    layers.append(("flag", False, {k: v for k, v in (flags or {}).items() if v is not None}))

    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    ignored: list[Ignored] = []
    for source, of_project, flat in layers:
        if of_project:
            flat = _screen(flat, source, merged, sources, ignored)
        for key, value in flat.items():
            merged[key] = value
            sources[key] = env_source(key) if source == "env" else source
    return LoadedSettings(settings=_validate(merged, sources), sources=sources,
                          project_files=tuple(str(f) for f in files), ignored=tuple(ignored))


def _screen(flat: dict[str, Any], source: str, merged: dict[str, Any], sources: dict[str, str],
            ignored: list[Ignored]) -> dict[str, Any]:
    """What a project's file may give: its allowed keys, each guard only as strict as the value
    below it (the user's) or stricter. A value it may not set is not even validated."""
    kept: dict[str, Any] = {}
    for key, value in flat.items():
        if key not in project.PROJECT_KEYS:
            ignored.append(Ignored(file=source, key=key))
        elif key in project.TIGHTEN:
            below = _get(_validate(merged, sources), key)
            asked = _get(_validate({**merged, key: value}, {**sources, key: source}), key)  # a bad value: its error
            if project.at_least_as_strict(key, asked, below):
                kept[key] = value
            else:
                ignored.append(Ignored(file=source, key=key, looser=True))
        else:
            kept[key] = value
    return kept


def _get(settings: Settings, key: str) -> Any:
    value: Any = settings
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _validate(merged: dict[str, Any], sources: dict[str, str]) -> Settings:
    nested: dict[str, Any] = {}
    for key, value in merged.items():
        if "." in key:
            section, sub = key.split(".", 1)
            nested.setdefault(section, {})[sub] = value
        else:
            nested[key] = value
    try:
        return Settings.model_validate(nested)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if key in merged or "." in key:
            source = sources.get(key, "default")
            raise ConfigError(
                f"invalid setting {key} = {merged.get(key)!r} (from {source}): {msg}",
                f"Fix it in {source}; settings.example.toml documents {key}.",
            ) from None
        # A rule across several keys of a section: name where each of them came from.
        where = ", ".join(f"{k} from {v}" for k, v in sources.items() if k.startswith(key + ".")) or "defaults"
        raise ConfigError(f"invalid [{key}] settings: {msg}", f"Check {where}.") from None


def env_source(key: str) -> str:
    return "env " + ENV_PREFIX + key.upper().replace(".", "__")

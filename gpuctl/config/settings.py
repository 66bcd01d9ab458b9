"""Settings: the pydantic models of every setting, their defaults, bounds and descriptions.

Where values come from (files, env, flags) and which wins: gpuctl/config/load.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from gpuctl.config.providers import PROVIDERS, unknown_provider
from gpuctl.model.endpoint import Endpoint
from gpuctl.payloads.gpuctl_protocol import GuardConfig as _OnInstance  # the watchdog's defaults are the settings'


class _Section(BaseModel):
    # inf and nan are refused everywhere: a price or budget of inf would be stored and break every report.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False, defer_build=True)


class LocalSettings(_Section):
    usd_per_hour: float = Field(0.0, ge=0, le=1e6, description="Price the local provider charges per hour (for cost reports).")


# The TensorFlow gpuctl is tested with (tests, CI and the examples run it): the default version.
TESTED_TENSORFLOW = "2.21"


class TrainSettings(_Section):
    entry: str = Field("train.py", min_length=1, description="Script the payload runs, relative to the project.")
    mixed_precision: Literal["auto", "on", "off"] = Field(
        "auto", description="auto: mixed_float16 on GPUs of compute capability >= 7.0."
    )
    memory_growth: bool = Field(True, description="Let TensorFlow grow GPU memory instead of taking it all.")
    budget_usd: float = Field(
        0.0, ge=0, le=1e6, description="Stop a run gracefully once its own epochs cost this many dollars (the "
        "payload counts them); 0 = no cap. Flag: `train --budget`. Forgotten with the run."
    )
    tensorflow: str = Field(
        TESTED_TENSORFLOW, pattern=r"^[0-9]+\.[0-9]+(\.[0-9]+)?$",
        description="TensorFlow version runs use (2.21 = the newest 2.21.x; 2.21.0 exactly). The instance gets it "
        "from a baked image, a TensorFlow DLAMI of that version, or gpuctl's setup step. Flag: `up --tf`.",
    )
    checkpoint: Literal["auto", "off"] = Field(
        "auto", description="auto: every Keras fit saves a checkpoint after each epoch in the run's outputs "
        "(BackupAndRestore), which `train --resume` starts from; off: none."
    )
    keras: Literal["auto", "2", "3"] = Field(
        "auto", description="Keras for the job: 2 = tf_keras with TF_USE_LEGACY_KERAS=1, 3 = the Keras TF ships; "
        "auto = 2 on multi-node clusters (Keras 3's fit fails under MultiWorkerMirroredStrategy), else 3."
    )
    tf_log_level: int = Field(
        2, ge=0, le=3, description="TF_CPP_MIN_LOG_LEVEL for the job: 2 hides TensorFlow's C++ info and warnings "
        "(oneDNN, cuInit), errors still show; 0 shows everything."
    )
    start_timeout_s: float = Field(
        120.0, ge=5, le=86400, description="Several nodes: a run whose job has not started on every node this many "
        "seconds after it started (past the queue) is stopped on all of them and named failed, with the nodes "
        "that did not start, instead of leaving the others waiting for them, billed."
    )
    gpu_sample_s: float = Field(
        2.0, ge=0, le=3600, description="How often the job asks nvidia-smi for its GPUs' utilisation and memory "
        "(each epoch's report and `gpuctl plan` show them); 0 = never."
    )
    requirements: str = Field(
        "", max_length=500, description="The project's requirements file, relative to the project (default: its "
        "requirements.txt, when there is one): installed on each node into a venv layered on the cluster's "
        "TensorFlow, once per file; a line that would replace TensorFlow is refused."
    )
    data: str = Field(
        "", max_length=1100, pattern=r"^(s3://.*|gpuctl:.*)?$", description="A data set in S3 each node fetches "
        "itself into its data store before the run starts ($GPUCTL_DATA_DIR), kept there for the next run: "
        "`s3://BUCKET/PREFIX`, or `gpuctl:NAME` for one `gpuctl data push` uploaded (docs/data.md); empty: none. Flag: `train --data`, which also takes a local directory to push."
    )
    data_link_hours: float = Field(
        6.0, gt=0, le=168, description="How long the presigned links a host fetches an S3 data set with stay valid "
        "(made on this machine with your credentials, never a key; made again for every train and resume)."
    )

    @field_validator("keras", mode="before")
    @classmethod
    def _keras_number(cls, v: object) -> object:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v  # keras = 2 in TOML

    @field_validator("entry")
    @classmethod
    def _relative(cls, v: str) -> str:
        if os.path.isabs(v) or ".." in Path(v).parts:
            raise ValueError("must be a path inside the project (relative, no '..')")
        return v


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """'45s', '30m', '6h', '1h30m', '2d', or plain seconds ('90'); '0' or 'off' = 0 (disabled)."""
    import re

    t = str(text).strip().lower().replace(" ", "")
    if t in ("0", "off", "none", ""):
        return 0.0
    if re.fullmatch(r"\d+(\.\d+)?", t):
        return _bounded(text, float(t))
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhd])", t)
    if not parts or "".join(n + u for n, u in parts) != t:
        raise ValueError(f"{text!r} is not a duration; use e.g. 45s, 30m, 6h, 1h30m")
    return _bounded(text, sum(float(n) * DURATION_UNITS[u] for n, u in parts))


MAX_DURATION_S = 366 * 86400.0


def _bounded(text: str, seconds: float) -> float:
    """A duration longer than a year is a typo (or 1e400, which is inf): refused at the edge."""
    if not seconds <= MAX_DURATION_S:
        raise ValueError(f"{text!r} is longer than a year")
    return seconds


def _duration(v: str) -> str:
    parse_duration(v)
    return v


def _spelled(seconds: float) -> str:
    """A default duration as a person writes it (120 -> "2m", 60 -> "60s")."""
    return f"{seconds / 60:g}m" if seconds >= 120 and seconds % 60 == 0 else f"{seconds:g}s"


class GuardSettings(_Section):
    max_hours: float = Field(
        8.0, gt=0, le=24 * 365, description="Hard cap armed at boot on cloud instances: power off this many hours after boot."
    )
    budget_usd: float = Field(
        _OnInstance.budget_usd, ge=0, le=1e6, description="The cluster's uptime budget: once the instance's uptime costs this much, the "
        "watchdog stops the jobs and shuts down; 0 = no cap. Flag: `guard set --budget`."
    )
    idle: str = Field("30m", description="Shut down after this long with no job, an idle GPU and no SSH session; 0 = never.")
    stall: str = Field("30m", description="A job whose GPU is idle and log silent this long is hung; 0 = never.")
    on_stall: Literal["warn", "fire"] = Field(cast(Literal["warn", "fire"], _OnInstance.on_stall),  # one of its choices
                                              description="warn: say so in the log and status; fire: shut down.")
    down_after_run: bool = Field(_OnInstance.down_after_run, description="Shut down a grace period after the run ends, success or failure.")
    grace: str = Field(_spelled(_OnInstance.grace_s), description="Time a stopped job gets to checkpoint, and the wait after a run before --down fires.")
    check_interval: str = Field(_spelled(_OnInstance.check_interval_s), description="How often the watchdog looks.")
    gpu_idle_percent: float = Field(_OnInstance.gpu_idle_percent, ge=0, le=100, description="GPU utilisation under this counts as idle.")
    on_fire: Literal["", "poweroff", "stop-jobs"] = Field(
        "", description="What shutting down means; empty: poweroff on aws, stop-jobs on ssh and local."
    )
    poweroff_command: str = Field(_OnInstance.poweroff_command, min_length=1, description="How `poweroff` is done.")

    _check_durations = field_validator("idle", "stall", "grace", "check_interval")(classmethod(lambda cls, v: _duration(v)))

    @model_validator(mode="after")
    def _interval_positive(self) -> "GuardSettings":
        # Whether idle and stall fit the interval is checked against the interval in force on the
        # instance (gpuctl.ops.guards.check_limits): a `guard set --idle 5s` on an instance that
        # checks every second must not be refused for the default 60 s.
        if parse_duration(self.check_interval) <= 0:
            raise ValueError("check_interval must be longer than 0")
        return self

    def seconds(self, name: str) -> float:
        return parse_duration(getattr(self, name))


class AwsSettings(_Section):
    region: str = Field("", description="AWS region; empty = boto3's own choice (AWS_REGION, the profile).")
    profile: str = Field("", description="AWS profile from ~/.aws; empty = boto3's default chain.")
    instance_type: str = Field("g5.xlarge", min_length=1, description="EC2 instance type.")
    market: Literal["spot", "on-demand"] = Field("spot", description="spot or on-demand.")
    max_price: float = Field(0.0, ge=0, le=1e6, description="Spot price cap in $/h; 0 = AWS's cap (the on-demand price).")
    fallback_on_demand: bool = Field(False, description="Launch on-demand when spot fails in every zone.")
    zone: str = Field("", pattern=r"^([a-z]{2}(-[a-z]+)+-[0-9][a-z]|)$",
                      description="Availability zone to launch in (and to create volumes in), e.g. us-east-1a; "
                      "empty = any zone offering the type (the cheapest spot price first).")
    placement: Literal["", "cluster"] = Field("", description="Multi-node clusters: \"cluster\" puts the nodes in "
                                              "a cluster placement group (low latency between them); \"\" = none.")
    image: str = Field("", description="AMI id to launch; empty = a baked image, a TensorFlow DLAMI or the base "
                       "image, in that order (see `gpuctl image`).")
    image_pattern: str = Field(
        "Deep Learning*AMI GPU TensorFlow {tf} (*", min_length=1,
        description="Name pattern of a TensorFlow DLAMI (owner amazon); {tf} (required) stands for "
        "train.tensorflow, {os} for the base OS's name (e.g. Ubuntu 22.04).",
    )
    base_os: Literal["ubuntu-22.04", "ubuntu-24.04"] = Field(
        "ubuntu-22.04", description="OS of the Base OSS Nvidia Driver GPU AMI that gpuctl sets TensorFlow up on."
    )
    disk_gb: int = Field(100, ge=8, le=16384, description="Root volume size (encrypted gp3) in GB.")
    ssh_cidr: str = Field("", description="Who may SSH in; empty = the caller's public address /32 (detected).")
    ssh_user: str = Field("ubuntu", min_length=1, description="Login user of the image.")
    wait_timeout_s: float = Field(900.0, gt=0, le=86400, description="How long `up` waits for running and for SSH.")
    checkpoints: Literal["s3", "instance"] = Field(
        "s3", description="Where runs keep checkpoints: s3 (a bucket of yours; they outlive the instance) or "
        "instance (its disk; gone with it).")
    checkpoint_expiry_days: int = Field(30, ge=0, le=3650, description="Days before the bucket deletes a checkpoint "
                                        "by itself (S3 lifecycle); 0 = kept until `gpuctl runs rm`.")
    imds_endpoint: str = Field("http://169.254.169.254", min_length=1, description="The instance metadata service "
                               "the watchdog asks for spot interruption notices.")
    checkpoint_versions_days: int = Field(3, ge=0, le=365, description="Days the bucket keeps a checkpoint's "
                                          "earlier version after it was overwritten or deleted, so an instance cannot "
                                          "destroy its cluster's checkpoints for good (billed as S3 storage); 0 = none.")
    imds_for_containers: bool = Field(False, description="Let containers on the instance reach its metadata service "
                                      "(and so the cluster's role): IMDS hop limit 2 instead of 1.")
    imds_poll_s: float = Field(5.0, ge=0.5, le=60, description="How often the watchdog asks it, in seconds (EC2 "
                               "recommends 5; the notice comes two minutes ahead).")

    @field_validator("ssh_cidr")
    @classmethod
    def _cidr(cls, v: str) -> str:
        if v:
            import ipaddress

            ipaddress.ip_network(v, strict=False)  # ValueError names the problem
        return v


class SshSettings(_Section):
    hosts: list[str] = Field(default_factory=list, description="user@host[:port] of each machine of an ssh cluster.")
    identity: str = Field("", description="Private key for the ssh provider; empty = ssh-agent and ~/.ssh keys.")
    usd_per_hour: float = Field(0.0, ge=0, le=1e6, description="What an hour of these machines costs you (for reports).")

    @field_validator("hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        for h in v:
            Endpoint.parse(h)  # ValueError says which one is wrong
        return v


class RecoverSettings(_Section):
    enabled: Literal["auto", "on", "off"] = Field("auto", description="Relaunch an interrupted run's instance and "
                                                  "resume the run where gpuctl watches it; auto = for spot clusters.")
    max_attempts: int = Field(3, ge=1, le=100, description="Replacements tried for one run before giving up.")
    fallback_on_demand: bool = Field(False, description="Replace a spot instance on-demand when spot fails.")


class RemoteSettings(_Section):
    python: str = Field("", description="Python on the instance that runs the payload; empty = find it.")
    workdir: str = Field("~/gpuctl", min_length=1, description="gpuctl's directory on remote hosts (an ssh "
                         "cluster works in WORKDIR/CLUSTER, so several can share a host).")
    connect_timeout_s: float = Field(120.0, gt=0, le=3600, description="How long to keep trying to connect over SSH.")
    command_timeout_s: float = Field(30.0, ge=1, le=3600, description="The deadline of one command on a host (tmux, a "
                                     "file read, a payload's check): past it the host counts as hung for the rest of "
                                     "that gpuctl command, and `down` releases the cluster anyway.")
    wheelhouse: str = Field(
        "", description="A directory of wheels on the host: the setup step installs TensorFlow from it alone "
        "(hosts without internet). Empty = PyPI."
    )
    ssh_config: str = Field(
        "", description="OpenSSH config file for host aliases (HostName, User, Port, IdentityFile, ProxyJump); "
        "empty = ~/.ssh/config if it exists."
    )


class DataSettings(_Section):
    upload_dirs: bool = Field(
        False, description="On aws: `train --data DIR` uploads DIR (changed files only) as the data set "
        "`gpuctl data push` would make of it, named DIRNAME-<8 hex of where it is>, and each node fetches it "
        "in its region (gpuctl:NAME), instead of pushing DIR from this machine to every node. Your settings "
        "alone (a project's gpuctl.toml cannot make gpuctl upload anything). docs/data.md."
    )


class Settings(_Section):
    provider: str = Field("aws", description="Where `gpuctl up` puts clusters: aws, ssh, local.")
    cluster: str = Field("default", description="Name `gpuctl up` gives a cluster when --name is not passed.")
    nodes: int = Field(1, ge=1, le=64, description="Machines `gpuctl up` puts in a cluster (aws: one zone; local: "
                       "workers on this machine; ssh: one per --host). Flag: `up --nodes`.")
    local: LocalSettings = LocalSettings()
    train: TrainSettings = TrainSettings()
    guards: GuardSettings = GuardSettings()
    aws: AwsSettings = AwsSettings()
    ssh: SshSettings = SshSettings()
    recover: RecoverSettings = RecoverSettings()
    remote: RemoteSettings = RemoteSettings()
    data: DataSettings = DataSettings()

    @field_validator("provider")
    @classmethod
    def _known_provider(cls, v: str) -> str:
        if v not in PROVIDERS:
            raise ValueError(f"{unknown_provider(v)} (known: {', '.join(sorted(PROVIDERS))})")
        return v

    @field_validator("cluster")
    @classmethod
    def _cluster_name(cls, v: str) -> str:
        return validate_name(v)


def validate_name(name: str) -> str:
    """Cluster names become directory, tmux and cloud tag values: keep them plain."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,39}", name):
        raise ValueError("use 1-40 letters, digits, '-' or '_', starting with a letter or digit")
    return name


def _known_keys() -> dict[str, str]:
    """Dotted key -> description, for every leaf setting."""
    keys: dict[str, str] = {}
    for name, field in Settings.model_fields.items():
        ann: object = field.annotation  # typed TypeForm (PEP 747), which this mypy reads as None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            for sub, subfield in ann.model_fields.items():
                keys[f"{name}.{sub}"] = subfield.description or ""
        else:
            keys[name] = field.description or ""
    return keys


KNOWN_KEYS = _known_keys()

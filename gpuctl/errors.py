"""The one error tree of gpuctl. Every error a user can cause carries an exit code and a hint.

The CLI maps these to `Error:` / `Hint:` lines and the exit code in exactly one place
(`gpuctl.cli.GpuctlGroup.invoke`); nothing else prints errors or calls sys.exit.
"""

from __future__ import annotations

from enum import IntEnum, unique


@unique  # a script tells every outcome apart: no two names share a number
class ExitCode(IntEnum):
    """Documented process exit codes (docs/cli.md "Errors and exit codes"); a test pins the numbers."""

    OK = 0
    INTERNAL = 1  # a bug in gpuctl: rerun with --debug and report it
    USAGE = 2  # bad command line (Click's own code)
    CONFIG = 3  # a bad setting in a file, env var or flag
    NOT_FOUND = 4  # unknown cluster or run
    CONFLICT = 5  # a name already in use, or no single cluster to pick
    PROJECT = 6  # the project to train is missing or has no entry point
    REMOTE = 7  # a command on the instance failed (tmux, copy, ...)
    RUN_FAILED = 8  # the training run ended with a non-zero status
    CLOUD = 9  # the cloud refused: credentials, permissions, image, quota, leak
    NO_CAPACITY = 10  # no zone had capacity for the request; try later, elsewhere, or on-demand
    DECLINED = 11  # the user answered no to a confirmation: nothing was done (was 1, shared with INTERNAL)
    DATA = 12  # the data set cannot be used: a malformed s3:// URL, no such bucket, access denied, empty, unsafe keys, no room
    BILLING = 13  # the bill or the budget as asked cannot be: tags not active, a budget in another currency
    INTERRUPTED = 130  # Ctrl-C


class GpuctlError(Exception):
    """Base class: `message` says what happened, `hint` what to do next."""

    exit_code: ExitCode = ExitCode.INTERNAL
    default_hint: str = "Rerun with --debug for the traceback."

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint or self.default_hint


class ConfigError(GpuctlError):
    exit_code = ExitCode.CONFIG
    default_hint = "Run `gpuctl config show` to see every setting and where it comes from."


class LedgerUnwritable(ConfigError):
    """The ledger cannot take a write (a full or read-only disk): what was written stays intact.
    `down` still ends the spend and says what it could not record."""


class NotFoundError(GpuctlError):
    exit_code = ExitCode.NOT_FOUND
    default_hint = "Run `gpuctl status` to list clusters and runs."


class ConflictError(GpuctlError):
    exit_code = ExitCode.CONFLICT
    default_hint = "Pick another name, or run `gpuctl status` to see what exists."


class NoClusterError(ConflictError):
    default_hint = "Start one with `gpuctl up`, or name one with --cluster."


class ProjectError(GpuctlError):
    exit_code = ExitCode.PROJECT
    default_hint = "Point gpuctl at a directory holding train.py, or set `[train] entry` in its gpuctl.toml."


class DataError(GpuctlError):
    """`--data s3://...` refused before anything starts (or its fetch failed on the host)."""

    exit_code = ExitCode.DATA
    default_hint = "Check the URL with `aws s3 ls s3://BUCKET/PREFIX/`; docs/data.md says what gpuctl needs."


class BillingError(GpuctlError):
    """The bill cannot be read as gpuctl needs it (its cost allocation tags not active), or the
    account's budget is not one gpuctl can take over (another currency). Nothing was changed."""

    exit_code = ExitCode.BILLING
    default_hint = "Run `gpuctl aws billing setup`; docs/billing.md says what AWS needs."


class RemoteError(GpuctlError):
    exit_code = ExitCode.REMOTE
    default_hint = "Run `gpuctl status`; rerun with --debug for the full command output."


class RemoteTimeout(RemoteError):
    """A command on the host ran past its deadline: the host answered once but does not now (a
    hung tmux, a host whose packets stopped). Unlike a host that never answered, `down` releases
    the cluster anyway and names the jobs it could not confirm gone."""


class Unconfirmed(RemoteError):
    """The host answers, but its tmux does not answer for a job being stopped: nothing could be
    signalled, and the job may run on. As with a RemoteTimeout, `down` releases anyway."""


class UnreadableFile(RemoteError):
    """The host answers, but a file of its cannot be read as one (a link loop, no permission): the
    instance's doing. A look names it and goes on; it never holds `down`."""


class RunFailedError(GpuctlError):
    exit_code = ExitCode.RUN_FAILED


class ConfirmationRequired(GpuctlError):
    exit_code = ExitCode.USAGE
    default_hint = "Pass -y to confirm, or run it in a terminal to be asked."


class CloudError(GpuctlError):
    exit_code = ExitCode.CLOUD
    default_hint = "Rerun with --debug to see the cloud's full answer."


class NoCapacityError(GpuctlError):
    exit_code = ExitCode.NO_CAPACITY


class RecoveryError(RunFailedError):
    """A preempted run that recovery could not bring back: every try is named."""

    default_hint = "Resume it when capacity returns: gpuctl train --resume RUN (gpuctl status offers it)."

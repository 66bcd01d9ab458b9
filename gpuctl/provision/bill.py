"""The account's bill and its backstop: what ops asks of the cloud that bills, whichever provider
the clusters use (only AWS has a bill gpuctl reads). Each is reached through the registry below, so
ops imports no provider (the layers contract), and boto3 is imported only when one is made."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from gpuctl.errors import ConfigError

if TYPE_CHECKING:  # the protocols' types only (the providers' modules build them)
    from gpuctl.model.bill import BilledRow, BudgetGone, BudgetState, TagState

TAG_KEYS = ("gpuctl:cluster", "gpuctl:owner", "gpuctl:created-by")  # every resource gpuctl makes carries them
MIN_MONTHLY_USD = 0.01  # AWS keeps a budget's cents: less would be a $0.00 budget, fired by the first cent


def check_limit(limit_usd: float) -> None:
    """A ConfigError unless `limit_usd` is a budget AWS keeps as given (finite, in cents)."""
    if not (math.isfinite(limit_usd) and limit_usd >= MIN_MONTHLY_USD):
        raise ConfigError(f"--monthly-usd {limit_usd} is not a limit",
                          f"Give a number of dollars, at least {MIN_MONTHLY_USD}.")


class CostExplorer(Protocol):
    requests: int  # the paid requests this one made so far

    def tag_states(self, keys: tuple[str, ...]) -> list[TagState]:
        """Each key as a cost allocation tag ("not seen yet" where AWS lists none)."""

    def activate(self, keys: tuple[str, ...]) -> list[str]:
        """Activate these keys; those AWS took."""

    def daily(self, start: str, end: str) -> list[BilledRow]:
        """Unblended cost of gpuctl's resources per day in [start, end), by cluster tag and service."""


class Budgets(Protocol):
    def check_set(self, email: str | None) -> None:
        """A ConfigError where `set` with this email would be refused before it asks AWS anything."""

    def set(self, limit_usd: float, email: str | None) -> BudgetState:
        """Make or update the budget and its actions."""

    def show(self) -> BudgetState | None:
        """The budget, or None where there is none."""

    def remove(self) -> BudgetGone: ...

    def lift(self) -> BudgetState:
        """Take the deny policy off again (the action reversed)."""


COST_EXPLORER = "gpuctl.provision.aws.billing:AwsCostExplorer"
BUDGETS = "gpuctl.provision.aws.budget:AwsBudgets"


def _made(target: str) -> type:
    module, _, attr = target.partition(":")
    return cast(type, getattr(importlib.import_module(module), attr))


def cost_explorer(profile: str = "") -> CostExplorer:
    return cast(CostExplorer, _made(COST_EXPLORER)(profile))


def budgets(home: Path, profile: str = "", region: str = "") -> Budgets:
    return cast(Budgets, _made(BUDGETS)(home, profile, region))


def budget_kept(home: Path) -> bool:
    """Whether `gpuctl aws budget set` made a budget from this home (asks nothing)."""
    return (Path(home) / "budget.json").is_file()

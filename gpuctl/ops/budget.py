"""`gpuctl aws budget set / show / rm / lift`, the budget's line in `status` and the warning `up`
gives when the month's forecast passes it. The budget is AWS's (provision/aws/budget.py): a
backstop that holds when gpuctl and its guards do not, updated by AWS a few times a day, so
not a guard (docs/billing.md)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from gpuctl.errors import BillingError, ConfigError, GpuctlError
from gpuctl.ops.session import Session
from gpuctl.provision.bill import Budgets, budget_kept, budgets, check_limit, cost_explorer

if TYPE_CHECKING:  # types only: `status` asks for a budget line and builds none of model.bill's models without one
    from gpuctl.model.bill import BudgetGone, BudgetState

FILTER_TAG = "gpuctl:created-by"  # the budget counts the resources carrying it: it must be active

# A local part, then a domain of non-empty labels (`a@b..com` is no address) and a top-level one.
_C = r"\s\x00-\x1f\x7f"  # no space, no control character anywhere in an address
EMAIL = re.compile(rf"[^@{_C}]{{1,64}}@(?=[^@{_C}]{{1,255}}$)[^@.{_C}]{{1,63}}(?:\.[^@.{_C}]{{1,63}})*\.[^@.{_C}]{{2,63}}")


def check_email(email: str | None) -> None:
    if email is not None and not EMAIL.fullmatch(email):
        raise ConfigError(f"--email {email!r} is not an email address",
                          "Give the address AWS should write to, e.g. --email you@example.com.")


def _budgets(s: Session) -> Budgets:
    aws = s.settings().settings.aws
    return budgets(s.home, aws.profile, aws.region)


def set_budget(s: Session, monthly_usd: float, email: str | None) -> BudgetState:
    check_email(email)
    check_limit(monthly_usd)
    backstop = _budgets(s)
    backstop.check_set(email)  # a missing --email is said before the paid question below
    # A budget filtered on a tag that is not a cost allocation tag counts nothing and never fires
    # (one Cost Explorer request, $0.01, before anything is made).
    (state,) = cost_explorer(s.settings().settings.aws.profile).tag_states((FILTER_TAG,))
    if state.status != "Active":
        raise BillingError(f"the cost allocation tag {FILTER_TAG} is not active ({state.status}): a budget on it "
                           "would count nothing and never fire",
                           "Run `gpuctl aws billing setup` first (a new key can take up to a day to appear).")
    return backstop.set(monthly_usd, email)


def show(s: Session) -> BudgetState | None:
    return _budgets(s).show()


def remove(s: Session) -> BudgetGone:
    return _budgets(s).remove()


def lift(s: Session) -> BudgetState:
    return _budgets(s).lift()


def line(s: Session) -> BudgetState | None:
    """The budget for `status`, where this home set one (else nothing is asked); None when AWS
    cannot say (a look never fails for it)."""
    if not budget_kept(s.home):
        return None
    try:
        return show(s)
    except GpuctlError as exc:
        s.note(f"budget not read: {exc.message}")
        return None


def forecast_warning(s: Session) -> str | None:
    """What `up` says before it launches when the month's forecast passes the budget."""
    state = line(s)
    if state is None or state.forecast_usd is None or state.forecast_usd <= state.limit_usd:
        return None
    return (f"warning: AWS forecasts ${state.forecast_usd:,.2f} this month on gpuctl's resources, past the budget "
            f"{state.name} of ${state.limit_usd:,.2f}: when actual spend passes it, AWS stops gpuctl's instances "
            "and denies new launches")

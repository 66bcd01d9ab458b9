"""The account's backstop: an AWS Budget on the monthly cost of gpuctl's resources (tag
gpuctl:created-by=gpuctl, a cost allocation tag: `gpuctl aws billing setup`), with two actions
that AWS runs when the actual spend passes the limit:
- stop: an SSM STOP_EC2_INSTANCES action on this install's running instances in one region,
  their ids kept current by `sync` at every launch (`up`, a replacement) and release (`down`);
  AWS takes no empty list, so while nothing runs the action is deleted, and made again later;
- deny: APPLY_IAM_POLICY of gpuctl-budget-deny (no RunInstances, RequestSpotInstances,
  StartInstances) to the caller's IAM user or role, until `lift` reverses it.
Budgets runs both with the role gpuctl-budget-action (trusting budgets.amazonaws.com only), made
here. Budgets updates its figures a few times a day: a backstop behind the guards, not a guard.
The budget's region, email and role are kept in the gpuctl home (budget.json, 0600) so that
`up` and `down` know whether there is an action to keep current without asking AWS."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from gpuctl.errors import BillingError, CloudError, ConfigError, GpuctlError
from gpuctl.model.bill import BudgetAction, BudgetGone, BudgetState
from gpuctl.model.untrusted import one_line
from gpuctl.provision.aws import access
from gpuctl.provision.aws.session import Aws, aws_errors, call_in, error_code
from gpuctl.provision.bill import check_limit

NAME = "gpuctl-backstop"
RECORD = "budget.json"
IAM_PATH = "/gpuctl-budget/"
ROLE = "gpuctl-budget-action"
DENY = "gpuctl-budget-deny"
STOP, DENY_KIND = "stop instances", "deny launches"
THRESHOLD = {"ActionThresholdValue": 100.0, "ActionThresholdType": "PERCENTAGE"}
DENIED = ["ec2:RunInstances", "ec2:RequestSpotInstances", "ec2:StartInstances"]


def record_path(home: Path) -> Path:
    return Path(home) / RECORD


def _kept(home: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(record_path(home).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _keep(home: Path, data: dict[str, Any]) -> None:
    path = record_path(home)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def _amount(spend: Any) -> float | None:
    try:
        return float(spend["Amount"])
    except (KeyError, TypeError, ValueError):
        return None


def _subject(arn: str) -> dict[str, list[str]]:
    """Who the deny policy goes on: the caller's IAM user, or the role it assumed."""
    kind, _, rest = arn.split(":", 5)[-1].partition("/")
    if kind == "user":
        return {"Users": [rest.rsplit("/", 1)[-1]]}
    if kind in ("assumed-role", "role"):
        return {"Roles": [rest.split("/")[0 if kind == "assumed-role" else -1]]}
    raise ConfigError(f"AWS budget actions cannot deny {arn}: it is not an IAM user or role",
                      "Use gpuctl as an IAM user or role (not the root user) for `gpuctl aws budget set`.")


class AwsBudgets:
    def __init__(self, home: Path, profile: str = "", region: str = ""):
        self.home = Path(home)
        self.profile = profile
        self.aws = Aws(region=region, profile=profile)
        self.region = self.aws.region
        self._who: dict[str, Any] = {}

    def _budgets(self) -> Any:
        return self.aws.client("budgets", "us-east-1")

    def _iam(self) -> Any:
        return self.aws.client("iam")

    def _identity(self) -> dict[str, Any]:
        if not self._who:
            self._who = dict(call_in("sts", self.aws.client("sts").get_caller_identity))
        return self._who

    @property
    def account(self) -> str:
        return str(self._identity()["Account"])

    def _described(self) -> dict[str, Any] | None:
        try:
            return dict(self._budgets().describe_budget(AccountId=self.account, BudgetName=NAME)["Budget"])
        except aws_errors() as exc:
            if error_code(exc) == "NotFoundException":
                return None
            raise _said(exc, "DescribeBudget") from exc

    def _actions(self) -> list[dict[str, Any]]:
        res = call_in("budgets", self._budgets().describe_budget_actions_for_budget, AccountId=self.account,
                      BudgetName=NAME)
        return [a for a in res.get("Actions", []) if isinstance(a, dict)]

    def check_set(self, email: str | None) -> None:
        self._email(email)

    def _email(self, email: str | None) -> str:
        """The address to tell: the one given, else the one kept at the last set."""
        found = email or (_kept(self.home) or {}).get("email")
        if not found:
            raise ConfigError("the first `gpuctl aws budget set` needs --email",
                              "AWS's budget actions tell someone when they fire: pass --email ADDR.")
        return str(found)

    def set(self, limit_usd: float, email: str | None) -> BudgetState:
        check_limit(limit_usd)
        email = self._email(email)
        existing = self._described()
        if existing is not None:
            unit = str(existing.get("BudgetLimit", {}).get("Unit", "USD"))
            if unit != "USD":
                raise BillingError(f"the AWS budget {NAME} is in {one_line(unit, 10)}, not USD",
                                   "Remove it in the Billing console (or `gpuctl aws budget rm`), then set it again "
                                   "in dollars; gpuctl does not convert currencies.")
        budget = {"BudgetName": NAME, "BudgetLimit": {"Amount": f"{limit_usd:.2f}", "Unit": "USD"},
                  "TimeUnit": "MONTHLY", "BudgetType": "COST",
                  "CostFilters": {"TagKeyValue": [f"user:{access.TAG_CREATED_BY}$gpuctl"]}}
        changed = []
        subscribers = [{"SubscriptionType": "EMAIL", "Address": email}]
        if existing is None:
            notes = [{"Notification": {"NotificationType": "ACTUAL", "ComparisonOperator": "GREATER_THAN",
                                       "Threshold": pct, "ThresholdType": "PERCENTAGE"}, "Subscribers": subscribers}
                     for pct in (80.0, 100.0)]
            call_in("budgets", self._budgets().create_budget, AccountId=self.account, Budget=budget,
                    NotificationsWithSubscribers=notes)
            changed.append("created")
        else:
            call_in("budgets", self._budgets().update_budget, AccountId=self.account, NewBudget=budget)
            changed.append(f"limit ${limit_usd:,.2f}")
        role = self._role()
        policy = self._deny_policy()
        _keep(self.home, {"region": self.region, "email": email, "role": role, "account": self.account})
        if not [a for a in self._actions() if a.get("ActionType") == "APPLY_IAM_POLICY"]:
            call_in("budgets", self._budgets().create_budget_action, AccountId=self.account, BudgetName=NAME,
                    NotificationType="ACTUAL", ActionType="APPLY_IAM_POLICY", ActionThreshold=THRESHOLD,
                    Definition={"IamActionDefinition": {"PolicyArn": policy, **_subject(str(self._identity()["Arn"]))}},
                    ExecutionRoleArn=role, ApprovalModel="AUTOMATIC", Subscribers=subscribers)
            changed.append("deny action")
        if self.sync(lambda _: None):
            changed.append("stop action")
        state = self.show()
        assert state is not None  # made above
        return state.model_copy(update={"changed": tuple(changed)})

    def _role(self) -> str:
        iam = self._iam()
        trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                         "Principal": {"Service": "budgets.amazonaws.com"}}]}
        try:
            arn = str(iam.create_role(RoleName=ROLE, Path=IAM_PATH, AssumeRolePolicyDocument=json.dumps(trust),
                                      Description="AWS Budgets runs gpuctl's budget actions with this role",
                                      Tags=[{"Key": access.TAG_CREATED_BY, "Value": "gpuctl"}])["Role"]["Arn"])
        except aws_errors() as exc:
            if error_code(exc) != "EntityAlreadyExists":
                raise _said(exc, "CreateRole", "iam") from exc
            # Made before (by gpuctl, or by an administrator once, so that gpuctl's identity
            # needs no right to write a role's policy): left as it is.
            return f"arn:aws:iam::{self.account}:role{IAM_PATH}{ROLE}"
        may = {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": ["ec2:StopInstances", "ec2:DescribeInstanceStatus"], "Resource": "*",
             "Condition": {"StringEquals": {f"aws:ResourceTag/{access.TAG_CREATED_BY}": "gpuctl"}}},
            {"Effect": "Allow", "Action": "ssm:StartAutomationExecution", "Resource": "*"},
            {"Effect": "Allow", "Action": ["iam:AttachUserPolicy", "iam:DetachUserPolicy", "iam:AttachRolePolicy",
                                           "iam:DetachRolePolicy"], "Resource": "*",
             "Condition": {"ArnLike": {"iam:PolicyARN": f"arn:aws:iam::*:policy{IAM_PATH}{DENY}"}}}]}
        call_in("iam", iam.put_role_policy, RoleName=ROLE, PolicyName="run-gpuctl-budget-actions",
                PolicyDocument=json.dumps(may))
        return arn

    def _deny_policy(self) -> str:
        doc = {"Version": "2012-10-17", "Statement": [{"Effect": "Deny", "Action": DENIED, "Resource": "*"}]}
        try:
            return str(self._iam().create_policy(PolicyName=DENY, Path=IAM_PATH, PolicyDocument=json.dumps(doc),
                                                 Description="gpuctl's budget passed: no more launches")["Policy"]["Arn"])
        except aws_errors() as exc:
            if error_code(exc) != "EntityAlreadyExists":
                raise _said(exc, "CreatePolicy", "iam") from exc
            return f"arn:aws:iam::{self.account}:policy{IAM_PATH}{DENY}"

    def sync(self, progress: Callable[[str], None]) -> bool:
        """The stop action's instances made this install's running ones in the budget's region
        (deleted while none runs: AWS takes no empty list). Whether it changed anything."""
        kept = _kept(self.home)
        if kept is None:
            return False
        region = str(kept.get("region") or self.region)
        aws = self.aws if region == self.region else Aws(region=region, profile=self.profile)
        owner = access.owner_id(self.home)
        res = call_in("ec2", aws.ec2().describe_instances, Filters=access.owner_filters(owner) + [
            {"Name": "instance-state-name", "Values": ["pending", "running"]}])
        ids = sorted(str(i["InstanceId"]) for r in res.get("Reservations", []) for i in r.get("Instances", []))[:100]
        stops = [a for a in self._actions() if a.get("ActionType") == "RUN_SSM_DOCUMENTS"]
        have = sorted(i for a in stops for i in a.get("Definition", {}).get("SsmActionDefinition", {})
                      .get("InstanceIds", []))
        if have == ids and len(stops) <= 1:
            return False
        definition = {"SsmActionDefinition": {"ActionSubType": "STOP_EC2_INSTANCES", "Region": aws.region,
                                              "InstanceIds": ids}}
        for extra in stops[1:] if ids else stops:
            call_in("budgets", self._budgets().delete_budget_action, AccountId=self.account, BudgetName=NAME,
                    ActionId=extra["ActionId"])
        if ids and stops:
            call_in("budgets", self._budgets().update_budget_action, AccountId=self.account, BudgetName=NAME,
                    ActionId=stops[0]["ActionId"], Definition=definition)
        elif ids:
            call_in("budgets", self._budgets().create_budget_action, AccountId=self.account, BudgetName=NAME,
                    NotificationType="ACTUAL", ActionType="RUN_SSM_DOCUMENTS", ActionThreshold=THRESHOLD,
                    Definition=definition, ExecutionRoleArn=str(kept["role"]), ApprovalModel="AUTOMATIC",
                    Subscribers=[{"SubscriptionType": "EMAIL", "Address": str(kept["email"])}])
        progress(f"budget {NAME}: its stop action now covers {', '.join(ids) or 'no instance'}")
        return True

    def show(self) -> BudgetState | None:
        budget = self._described()
        if budget is None:
            return None
        spend = budget.get("CalculatedSpend", {})
        limit = budget.get("BudgetLimit", {})
        shown = []
        for a in self._actions():
            ssm = a.get("Definition", {}).get("SsmActionDefinition")
            shown.append(BudgetAction(
                kind=STOP if ssm else DENY_KIND, action_id=one_line(a.get("ActionId", ""), 80),
                status=one_line(a.get("Status", "?"), 40),
                instance_ids=tuple(one_line(i, 40) for i in (ssm or {}).get("InstanceIds", [])[:100]),
                region=one_line(ssm["Region"], 40) if ssm and ssm.get("Region") else None))
        kept = _kept(self.home) or {}
        return BudgetState(name=NAME, limit_usd=_amount(limit) or 0.0, currency=one_line(limit.get("Unit", "USD"), 10),
                           actual_usd=_amount(spend.get("ActualSpend")), forecast_usd=_amount(spend.get("ForecastedSpend")),
                           emails=(str(kept["email"]),) if kept.get("email") else (), actions=tuple(shown))

    def lift(self) -> BudgetState:
        fired = [a for a in self._actions() if a.get("ActionType") == "APPLY_IAM_POLICY"
                 and a.get("Status") == "EXECUTION_SUCCESS"]
        for a in fired:
            call_in("budgets", self._budgets().execute_budget_action, AccountId=self.account, BudgetName=NAME,
                    ActionId=a["ActionId"], ExecutionType="REVERSE_BUDGET_ACTION")
        state = self.show()
        if state is None:
            raise CloudError(f"there is no AWS budget {NAME}", "Set one: gpuctl aws budget set --monthly-usd N --email ADDR")
        return state.model_copy(update={"changed": ("lifted",) if fired else ("nothing to lift: the deny action "
                                                                                "has not fired",)})

    def remove(self) -> BudgetGone:
        if self._described() is None:
            record_path(self.home).unlink(missing_ok=True)
            return BudgetGone(name=NAME, removed=False)
        self.lift()  # what the deny action applied goes first
        for a in self._actions():
            call_in("budgets", self._budgets().delete_budget_action, AccountId=self.account, BudgetName=NAME,
                    ActionId=a["ActionId"])
        call_in("budgets", self._budgets().delete_budget, AccountId=self.account, BudgetName=NAME)
        iam = self._iam()
        steps: list[tuple[Callable[..., Any], dict[str, str]]] = [
            (iam.delete_role_policy, {"RoleName": ROLE, "PolicyName": "run-gpuctl-budget-actions"}),
            (iam.delete_role, {"RoleName": ROLE}),
            (iam.delete_policy, {"PolicyArn": f"arn:aws:iam::{self.account}:policy{IAM_PATH}{DENY}"})]
        for step, params in steps:
            try:
                step(**params)
            except aws_errors():  # gone already, or still attached somewhere: the budget is what mattered
                pass
        record_path(self.home).unlink(missing_ok=True)
        return BudgetGone(name=NAME, removed=True)


def _said(exc: BaseException, action: str, service: str = "budgets") -> GpuctlError:
    from gpuctl.provision.aws.session import translate

    return translate(exc, action, service)


def sync(home: Path, profile: str, progress: Callable[[str], None]) -> None:
    """After a launch or a release: the stop action's instances made current, where a budget is
    set. Never fails the command it follows (`down` above all): a failure is said and left."""
    kept = _kept(home)
    if kept is None:
        return
    try:
        AwsBudgets(home, profile, str(kept.get("region") or "")).sync(progress)
    except Exception as exc:  # noqa: BLE001 - GpuctlError or botocore's: said, never raised past `down`
        message = exc.message if isinstance(exc, GpuctlError) else one_line(exc, 300)
        progress(f"warning: budget {NAME}'s stop action not updated ({message}); `gpuctl aws budget set` again "
                 "updates it")

"""The account's backstop (issue 41 item 3): `gpuctl aws budget set` makes an AWS Budget on the cost
of gpuctl's resources (tag gpuctl:created-by=gpuctl) with two actions: stop gpuctl's running
instances (an SSM STOP_EC2_INSTANCES action, its instance ids kept current at every `up`, a
replacement's launch and `down`) and apply a deny policy to the caller's identity (lifted by
`gpuctl aws budget lift`). moto makes budgets but has no UpdateBudget and no budget actions: those
calls are added to the moto server (tests/aws_billing.py, as tests/aws.py adds placement groups).

Bad inputs tried: --monthly-usd 0, negative, inf, 1e400, nan and 0.001, no --email the first time
(said before the paid tag question), a malformed email (a@b..com too), a
budget of gpuctl's name in another currency, no permission for budgets:ModifyBudget; each makes
nothing (no budget, no role, no policy)."""

from __future__ import annotations

import json

import pytest

from gpuctl.ledger import Ledger
from tests.aws import ACCOUNT, live_instances, moto_client
from tests.aws_billing import GPUCTL_KEYS, budget_actions_as_aws_does, cost_allocation_tags_as_aws_does, deny

UP = ["up", "--spot", "--type", "g5.xlarge", "--ssh-cidr", "203.0.113.5/32", "--no-wait", "-y"]
NAME = "gpuctl-backstop"


@pytest.fixture
def actions(aws, monkeypatch):
    cost_allocation_tags_as_aws_does(monkeypatch, active=GPUCTL_KEYS)
    return budget_actions_as_aws_does(monkeypatch)


def budgets():
    return moto_client("budgets").describe_budgets(AccountId=ACCOUNT).get("Budgets", [])


def stop_ids(actions):
    return sorted(i for a in actions.values() if a["ActionType"] == "RUN_SSM_DOCUMENTS"
                  for i in a["Definition"]["SsmActionDefinition"]["InstanceIds"])


def made_nothing(actions):
    iam = moto_client("iam")
    assert budgets() == [] and actions == {}
    assert iam.list_roles(PathPrefix="/gpuctl-budget/")["Roles"] == []
    assert iam.list_policies(Scope="Local", PathPrefix="/gpuctl-budget/")["Policies"] == []


def test_set_follows_up_replacement_and_down_show_lift_rm(gpuctl, aws, actions, isolated):
    made = json.loads(gpuctl("aws", "budget", "set", "--monthly-usd", "50", "--email", "me@example.com", "-y",
                             "--json").stdout)
    (budget,) = budgets()
    assert budget["BudgetName"] == NAME and budget["BudgetLimit"] == {"Amount": "50.00", "Unit": "USD"}
    assert budget["TimeUnit"] == "MONTHLY" and budget["CostFilters"] == {"TagKeyValue": ["user:gpuctl:created-by$gpuctl"]}
    notes = moto_client("budgets").describe_notifications_for_budget(AccountId=ACCOUNT, BudgetName=NAME)["Notifications"]
    assert sorted(n["Threshold"] for n in notes) == [80.0, 100.0]
    (deny_action,) = [a for a in actions.values() if a["ActionType"] == "APPLY_IAM_POLICY"]
    assert deny_action["Definition"]["IamActionDefinition"]["PolicyArn"].endswith(":policy/gpuctl-budget/gpuctl-budget-deny")
    assert deny_action["Subscribers"] == [{"SubscriptionType": "EMAIL", "Address": "me@example.com"}]
    assert stop_ids(actions) == []  # nothing of gpuctl's runs: AWS takes no empty instance list
    assert made["limit_usd"] == 50 and "created" in made["changed"]

    gpuctl(*UP)
    (inst,) = live_instances(aws)
    assert stop_ids(actions) == [inst["InstanceId"]]
    (stop,) = [a for a in actions.values() if a["ActionType"] == "RUN_SSM_DOCUMENTS"]
    assert stop["Definition"]["SsmActionDefinition"]["ActionSubType"] == "STOP_EC2_INSTANCES"
    assert stop["ActionThreshold"] == {"ActionThresholdValue": 100.0, "ActionThresholdType": "PERCENTAGE"}

    # A spot replacement is `launch` on the cluster's spec again (ops/recovery.py): EC2 ended the
    # first (as it does for spot capacity), the replacement takes its place in the action.
    from gpuctl.provision import get_provider

    aws.terminate_instances(InstanceIds=[inst["InstanceId"]])
    led = Ledger(isolated)
    spec = led.live_cluster("default").spec
    led.close()
    (new,) = get_provider(isolated, spec).launch(print, wait_ssh=False)
    assert new.id != inst["InstanceId"] and stop_ids(actions) == [new.id]

    out = gpuctl("status").stdout
    assert "AWS budget gpuctl-backstop: $50.00/month" in out
    shown = json.loads(gpuctl("aws", "budget", "show", "--json").stdout)
    assert shown["limit_usd"] == 50 and {a["status"] for a in shown["actions"]} == {"STANDBY"}

    gpuctl("down", "-y")
    assert stop_ids(actions) == []

    # The budget passed: AWS applied the deny policy. `lift` reverses it.
    deny_action["Status"] = "EXECUTION_SUCCESS"
    assert "FIRED" in gpuctl("aws", "budget", "show").stdout
    lifted = json.loads(gpuctl("aws", "budget", "lift", "--json").stdout)
    assert deny_action["Status"] == "REVERSE_SUCCESS" and "lifted" in lifted["changed"]

    gpuctl("aws", "budget", "set", "--monthly-usd", "80", "-y")  # an update: the email kept
    assert budgets()[0]["BudgetLimit"]["Amount"] == "80.00" and len(actions) == 1

    gpuctl("aws", "budget", "rm", "-y")
    assert budgets() == [] and actions == {}
    assert "No gpuctl budget" in gpuctl("aws", "budget", "show").stdout
    assert "AWS budget" not in gpuctl("status").stdout


def test_up_warns_when_the_forecast_passes_the_budget(gpuctl, aws, actions):
    from moto.budgets.models import budgets_backends

    gpuctl("aws", "budget", "set", "--monthly-usd", "20", "--email", "me@example.com", "-y")
    kept = budgets_backends[ACCOUNT]["aws"].budgets[ACCOUNT][NAME]
    kept.budget["CalculatedSpend"] = {"ActualSpend": {"Amount": "12.5", "Unit": "USD"},
                                      "ForecastedSpend": {"Amount": "31.0", "Unit": "USD"}}
    err = gpuctl(*UP).stderr
    assert "forecast" in err and "$31.00" in err and "$20.00" in err


@pytest.mark.parametrize(("args", "code", "said"), [
    (["--monthly-usd", "0"], 2, "not a positive number"),
    (["--monthly-usd", "-5"], 2, "not a positive number"),
    (["--monthly-usd", "10"], 3, "--email"),
    (["--monthly-usd", "10", "--email", "not-an-address"], 3, "email"),
    (["--monthly-usd", "10", "--email", "me@example..com"], 3, "email"),
    (["--monthly-usd", "10", "--email", "me\x1b[31m@example.com"], 3, "email"),
    # "$inf" a month, and a budget under a cent (AWS keeps cents: $0.00, fired by the first one).
    (["--monthly-usd", "inf", "--email", "me@example.com"], 2, "not a finite number"),
    (["--monthly-usd", "1e400", "--email", "me@example.com"], 2, "not a finite number"),
    (["--monthly-usd", "nan", "--email", "me@example.com"], 2, "not a finite number"),
    (["--monthly-usd", "0.001", "--email", "me@example.com"], 2, "is under 0.01"),
])
def test_bad_budget_input_makes_nothing(gpuctl, aws, actions, args, code, said):
    err = gpuctl("aws", "budget", "set", *args, "-y", code=code).stderr
    assert said in err
    made_nothing(actions)


def test_a_missing_email_is_said_before_the_paid_tag_question(gpuctl, aws, actions, monkeypatch):
    from moto.ce.responses import CostExplorerResponse

    asked: list[int] = []
    real = CostExplorerResponse.list_cost_allocation_tags
    monkeypatch.setattr(CostExplorerResponse, "list_cost_allocation_tags", lambda self: asked.append(1) or real(self))
    err = gpuctl("aws", "budget", "set", "--monthly-usd", "10", "-y", code=3).stderr
    assert "needs --email" in err and asked == [], "a Cost Explorer request ($0.01) before the missing --email"
    made_nothing(actions)


def test_a_budget_in_another_currency_is_not_taken_over(gpuctl, aws, actions):
    moto_client("budgets").create_budget(AccountId=ACCOUNT, Budget={
        "BudgetName": NAME, "BudgetLimit": {"Amount": "40", "Unit": "EUR"}, "TimeUnit": "MONTHLY", "BudgetType": "COST"})
    err = gpuctl("aws", "budget", "set", "--monthly-usd", "10", "--email", "me@example.com", "-y", code=13).stderr
    assert "EUR" in err and "Hint:" in err
    assert budgets()[0]["BudgetLimit"] == {"Amount": "40", "Unit": "EUR"} and actions == {}


def test_no_permission_for_budgets_names_the_action(gpuctl, aws, actions, monkeypatch):
    from moto.budgets.responses import BudgetsResponse

    deny(monkeypatch, BudgetsResponse, "create_budget", "budgets:ModifyBudget")
    err = gpuctl("aws", "budget", "set", "--monthly-usd", "10", "--email", "me@example.com", "-y", code=9).stderr
    assert "Error: not allowed to call budgets:ModifyBudget" in err
    made_nothing(actions)


def test_a_budget_on_a_tag_not_active_is_refused(gpuctl, aws, actions, monkeypatch):
    cost_allocation_tags_as_aws_does(monkeypatch, active=())  # seen, not activated
    err = gpuctl("aws", "budget", "set", "--monthly-usd", "10", "--email", "me@example.com", "-y", code=13).stderr
    assert "gpuctl:created-by is not active" in err and "gpuctl aws billing setup" in err
    made_nothing(actions)

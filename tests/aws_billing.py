"""What the billing tests need of the moto server (tests/aws.py) beyond what moto 5.2 has.

- Cost Explorer: moto answers GetCostAndUsage with results a test queues over HTTP
  (`/moto-api/static/ce/cost-and-usage-results`: the first request takes the first result, the same
  request again gets the same one); `queue_bill` does that. Every request is counted (`ce_requests`).
- Cost allocation tags: moto has neither ListCostAllocationTags nor UpdateCostAllocationTagsStatus;
  they are added to the CE responses the ThreadedMotoServer serves (as tests/aws.py adds placement
  groups), with AWS's behaviour: a key is listed only once AWS has seen it on a resource, and
  activating a key it has not seen answers an error entry for that key (not an HTTP error).
- Budgets: moto makes budgets but has no UpdateBudget and no budget actions; the calls gpuctl makes
  are added the same way, with AWS's answers (an action's status STANDBY until it fires;
  ExecuteBudgetAction REVERSE_BUDGET_ACTION puts it back to REVERSE_SUCCESS).
- No permission: `deny` makes one action answer AccessDeniedException with AWS's message. moto
  checks no IAM policy by default, so the answer is injected into its response (a real HTTP error
  answer through gpuctl's real client), not a Stubber.
"""

from __future__ import annotations

import json
import uuid
import urllib.request
from typing import Any

from tests.aws import ACCOUNT


def queue_bill(moto_server: str, *results: dict[str, Any]) -> None:
    """Queue GetCostAndUsage answers (each the whole answer: ResultsByTime, ...)."""
    body = json.dumps({"account_id": ACCOUNT, "results": [
        {"DimensionValueAttributes": [], **r} for r in results]}).encode()
    req = urllib.request.Request(moto_server + "/moto-api/static/ce/cost-and-usage-results", data=body,
                                 method="POST", headers={"Content-Type": "application/json"})
    assert urllib.request.urlopen(req).status == 201


def day_result(day: str, groups: dict[tuple[str, str], float], estimated: bool = False) -> dict[str, Any]:
    """One day of a GetCostAndUsage answer grouped by TAG gpuctl:cluster then SERVICE, as AWS
    writes it: the tag group's key is `gpuctl:cluster$VALUE` (`gpuctl:cluster$` for no value)."""
    import datetime as dt

    end = (dt.date.fromisoformat(day) + dt.timedelta(days=1)).isoformat()
    return {"TimePeriod": {"Start": day, "End": end}, "Total": {}, "Estimated": estimated, "Groups": [
        {"Keys": [f"gpuctl:cluster${cluster}", service],
         "Metrics": {"UnblendedCost": {"Amount": f"{usd:.10f}", "Unit": "USD"}}}
        for (cluster, service), usd in groups.items()]}


def ce_requests(monkeypatch) -> list[dict[str, Any]]:
    """Every GetCostAndUsage request the server gets from now on, as sent."""
    from moto.ce.responses import CostExplorerResponse

    seen: list[dict[str, Any]] = []
    original = CostExplorerResponse.get_cost_and_usage

    def get_cost_and_usage(self):
        seen.append(json.loads(self.body))
        return original(self)

    monkeypatch.setattr(CostExplorerResponse, "get_cost_and_usage", get_cost_and_usage)
    return seen


GPUCTL_KEYS = ("gpuctl:cluster", "gpuctl:owner", "gpuctl:created-by")


def cost_allocation_tags_as_aws_does(monkeypatch, seen: tuple[str, ...] = GPUCTL_KEYS,
                                     active: tuple[str, ...] = ()) -> dict[str, str]:
    """The cost allocation tags AWS has seen (key -> "Active"/"Inactive"); the dict is the state."""
    from moto.ce.responses import CostExplorerResponse

    state = {key: ("Active" if key in active else "Inactive") for key in seen}

    def list_cost_allocation_tags(self):
        params = json.loads(self.body or "{}")
        keys = params.get("TagKeys") or list(state)
        return json.dumps({"CostAllocationTags": [
            {"TagKey": k, "Type": "UserDefined", "Status": state[k], "LastUpdatedDate": "2026-12-01T00:00:00Z"}
            for k in keys if k in state and (not params.get("Status") or state[k] == params["Status"])]})

    def update_cost_allocation_tags_status(self):
        errors = []
        for item in json.loads(self.body)["CostAllocationTagsStatus"]:
            if item["TagKey"] not in state:
                errors.append({"TagKey": item["TagKey"], "Code": "TagKeysNotFoundException",
                               "Message": "Failed to update Cost Allocation Tag status for tag key"})
            else:
                state[item["TagKey"]] = item["Status"]
        return json.dumps({"Errors": errors})

    for fn in (list_cost_allocation_tags, update_cost_allocation_tags_status):
        monkeypatch.setattr(CostExplorerResponse, fn.__name__, fn, raising=False)
    return state


def budget_actions_as_aws_does(monkeypatch) -> dict[str, dict[str, Any]]:
    """UpdateBudget and the budget actions' calls gpuctl makes; the actions by id (the state)."""
    from moto.budgets.exceptions import NotFoundException
    from moto.budgets.responses import BudgetsResponse

    actions: dict[str, dict[str, Any]] = {}

    def update_budget(self):
        new = self._get_param("NewBudget")
        budget = self.backend.budgets[self._get_param("AccountId")].get(new["BudgetName"])
        if budget is None:
            raise NotFoundException(f"Unable to update budget: {new['BudgetName']} - the budget doesn't exist.")
        budget.budget.update(new)
        return json.dumps({})

    def create_budget_action(self):
        params = json.loads(self.body)
        if params["BudgetName"] not in self.backend.budgets[params["AccountId"]]:
            raise NotFoundException(f"Unable to create action: {params['BudgetName']} - the budget doesn't exist.")
        action_id = str(uuid.uuid4())  # AWS: a UUID (botocore checks its length)
        actions[action_id] = {**{k: v for k, v in params.items() if k != "AccountId"}, "ActionId": action_id,
                              "Status": "STANDBY"}
        return json.dumps({"AccountId": params["AccountId"], "BudgetName": params["BudgetName"], "ActionId": action_id})

    def described(params):
        return [a for a in actions.values() if a["BudgetName"] == params["BudgetName"]]

    def describe_budget_actions_for_budget(self):
        return json.dumps({"Actions": described(json.loads(self.body))})

    def update_budget_action(self):
        params = json.loads(self.body)
        if params["ActionId"] not in actions:
            raise NotFoundException(f"Unable to update action: {params['ActionId']} - the action doesn't exist.")
        old = dict(actions[params["ActionId"]])
        actions[params["ActionId"]].update({k: v for k, v in params.items() if k not in ("AccountId", "ActionId")})
        return json.dumps({"AccountId": params["AccountId"], "BudgetName": params["BudgetName"],
                           "OldAction": old, "NewAction": actions[params["ActionId"]]})

    def delete_budget_action(self):
        params = json.loads(self.body)
        if params["ActionId"] not in actions:
            raise NotFoundException(f"Unable to delete action: {params['ActionId']} - the action doesn't exist.")
        return json.dumps({"AccountId": params["AccountId"], "BudgetName": params["BudgetName"],
                           "Action": actions.pop(params["ActionId"])})

    def execute_budget_action(self):
        params = json.loads(self.body)
        action = actions[params["ActionId"]]
        action["Status"] = {"REVERSE_BUDGET_ACTION": "REVERSE_SUCCESS", "RESET_BUDGET_ACTION": "STANDBY"}.get(
            params["ExecutionType"], "EXECUTION_SUCCESS")
        return json.dumps({"AccountId": params["AccountId"], "BudgetName": params["BudgetName"],
                           "ActionId": params["ActionId"], "ExecutionType": params["ExecutionType"]})

    for fn in (update_budget, create_budget_action, describe_budget_actions_for_budget, update_budget_action,
               delete_budget_action, execute_budget_action):
        monkeypatch.setattr(BudgetsResponse, fn.__name__, fn, raising=False)
    return actions


def deny(monkeypatch, response_class: type, method: str, action: str) -> None:
    """`method` of a moto response class answers AccessDeniedException, as AWS does for an
    identity whose policies do not allow `action` (e.g. ce:GetCostAndUsage)."""
    from moto.core.exceptions import JsonRESTError

    def refused(self):
        raise JsonRESTError("AccessDeniedException", f"User: arn:aws:iam::{ACCOUNT}:user/test is not authorized to "
                            f"perform: {action} because no identity-based policy allows the {action} action")

    monkeypatch.setattr(response_class, method, refused, raising=False)

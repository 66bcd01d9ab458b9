"""Cost Explorer: gpuctl's tags as cost allocation tags (ListCostAllocationTags,
UpdateCostAllocationTagsStatus) and the daily bill of gpuctl's resources (GetCostAndUsage,
unblended, grouped by the gpuctl:cluster tag and then by service). Each request costs $0.01
(`requests` counts them); Cost Explorer's endpoint is us-east-1's, whatever the clusters' region."""

from __future__ import annotations

import math
from typing import Any

from gpuctl.errors import BillingError
from gpuctl.model.bill import BilledRow, TagState
from gpuctl.model.untrusted import one_line
from gpuctl.provision.aws.access import TAG_CLUSTER, TAG_CREATED_BY
from gpuctl.provision.aws.session import Aws, call_in

CE_REGION = "us-east-1"
MAX_PAGES = 20  # a bound on one answer (about 14 months of days, grouped): more is not AWS's answer
NOT_SEEN = "not seen yet"


def _amount(metrics: Any) -> float:
    try:
        usd = float(metrics["UnblendedCost"]["Amount"])
    except (KeyError, TypeError, ValueError):
        return 0.0
    return usd if math.isfinite(usd) else 0.0


class AwsCostExplorer:
    def __init__(self, profile: str = ""):
        self.aws = Aws(region=CE_REGION, profile=profile)
        self.requests = 0

    def _ce(self) -> Any:
        return self.aws.client("ce", CE_REGION)

    def tag_states(self, keys: tuple[str, ...]) -> list[TagState]:
        self.requests += 1
        res = call_in("ce", self._ce().list_cost_allocation_tags, TagKeys=list(keys), Type="UserDefined")
        seen = {str(t.get("TagKey")): t for t in res.get("CostAllocationTags", []) if isinstance(t, dict)}
        return [TagState(key=k, status=one_line(seen[k].get("Status", "?"), 40),
                         last_updated=str(seen[k].get("LastUpdatedDate") or "")[:40] or None)
                if k in seen else TagState(key=k, status=NOT_SEEN) for k in keys]

    def activate(self, keys: tuple[str, ...]) -> list[str]:
        if not keys:
            return []
        self.requests += 1
        res = call_in("ce", self._ce().update_cost_allocation_tags_status,
                      CostAllocationTagsStatus=[{"TagKey": k, "Status": "Active"} for k in keys])
        refused = {str(e.get("TagKey")) for e in res.get("Errors", []) if isinstance(e, dict)}
        return [k for k in keys if k not in refused]

    def daily(self, start: str, end: str) -> list[BilledRow]:
        ask: dict[str, Any] = {
            "TimePeriod": {"Start": start, "End": end}, "Granularity": "DAILY", "Metrics": ["UnblendedCost"],
            "GroupBy": [{"Type": "TAG", "Key": TAG_CLUSTER}, {"Type": "DIMENSION", "Key": "SERVICE"}],
            "Filter": {"Tags": {"Key": TAG_CREATED_BY, "Values": ["gpuctl"]}},
        }
        rows: list[BilledRow] = []
        for _ in range(MAX_PAGES):
            self.requests += 1
            res = call_in("ce", self._ce().get_cost_and_usage, **ask)
            for period in res.get("ResultsByTime", []):
                rows.extend(_rows(period))
            token = res.get("NextPageToken")
            if not token:
                return rows
            ask["NextPageToken"] = token
        # Not a part of the answer kept as if it were all of it: the days of the pages not read
        # would be kept as asked, and a settled day is never asked again (ops/billing.py).
        raise BillingError(f"Cost Explorer's answer for {start} to {end} runs past {MAX_PAGES} pages "
                           f"({self.requests} requests, ${self.requests * 0.01:.2f}); none of it was kept",
                           "Ask for fewer days at a time: `gpuctl cost --billed --since YYYY-MM-DD`.")


def _rows(period: Any) -> list[BilledRow]:
    if not isinstance(period, dict):
        return []
    day = str(period.get("TimePeriod", {}).get("Start", ""))[:10]
    estimated = bool(period.get("Estimated", False))
    rows = []
    for group in period.get("Groups", []) or []:
        keys = group.get("Keys", []) if isinstance(group, dict) else []
        if len(keys) != 2:
            continue
        tag, _, value = str(keys[0]).partition("$")
        rows.append(BilledRow(day=day, cluster=one_line(value, 100) if tag == TAG_CLUSTER else "",
                              service=one_line(keys[1], 100), usd=_amount(group.get("Metrics")),
                              estimated=estimated))
    return rows

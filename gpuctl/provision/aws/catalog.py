"""What EC2 offers: instance types, the zones that offer them, and prices (images: images.py)."""

from __future__ import annotations

import datetime as dt
import difflib
import json
import time
from pathlib import Path
from typing import Any

from gpuctl.errors import CloudError, ConfigError
from gpuctl.provision.aws.session import Aws, aws_errors, call, error_code, translate

# On-demand Linux $/h in us-east-1, used only when the Price List API cannot answer (no
# permission, no network). Reported as "built-in table (2025-01)" so nobody mistakes it for a quote.
PRICE_TABLE_DATE = "2025-01"
ON_DEMAND_USD = {
    "g4dn.xlarge": 0.526, "g4dn.2xlarge": 0.752, "g4dn.4xlarge": 1.204, "g4dn.8xlarge": 2.176,
    "g4dn.12xlarge": 3.912, "g4dn.16xlarge": 4.352,
    "g5.xlarge": 1.006, "g5.2xlarge": 1.212, "g5.4xlarge": 1.624, "g5.8xlarge": 2.448,
    "g5.12xlarge": 5.672, "g5.16xlarge": 4.096, "g5.24xlarge": 8.144, "g5.48xlarge": 16.288,
    "g6.xlarge": 0.8048, "g6.2xlarge": 0.9776, "g6.4xlarge": 1.3232, "g6.8xlarge": 2.0144,
    "g6e.xlarge": 1.861, "g6e.2xlarge": 2.24208,
    "p3.2xlarge": 3.06, "p3.8xlarge": 12.24, "p3.16xlarge": 24.48,
    "p4d.24xlarge": 32.7726, "p5.48xlarge": 98.32,
}


# The OSS-driver base AMIs list G4dn, G5, G6, G6e, P4 and P5; their driver no longer supports the
# P2 (K80) and P3 (V100) families: such a type runs only on an image pinned with --image.
NOT_ON_BASE = frozenset({"p2", "p3", "p3dn"})
# The GPU types every hint suggests: none of them is refused on the base image.
SUGGESTED_TYPES = ("g4dn.xlarge", "g5.xlarge", "g6.xlarge", "p4d.24xlarge")


def suggested_types() -> str:
    """The GPU types to name in a hint, as `a, b, c, ...`."""
    return ", ".join(SUGGESTED_TYPES) + ", ..."


def on_base(instance_type: str) -> bool:
    """Whether the type can boot the Base OSS Nvidia Driver GPU AMI."""
    return instance_type.split(".")[0] not in NOT_ON_BASE


def instance_type_info(aws: Aws, instance_type: str, image_pinned: bool = False) -> dict[str, Any]:
    """DescribeInstanceTypes for one type; a typo gets a did-you-mean from the region's list (of
    types gpuctl would launch: none the base image refuses, unless an image is pinned)."""

    ec2 = aws.ec2()
    try:
        found = aws.recent(("DescribeInstanceTypes", instance_type),
                           lambda: ec2.describe_instance_types(InstanceTypes=[instance_type])["InstanceTypes"])
    except aws_errors() as exc:
        if error_code(exc) not in ("InvalidInstanceType", "InvalidParameterValue"):
            raise translate(exc, "DescribeInstanceTypes") from exc
        found = []
    if found:
        return found[0]
    # The region's offerings are names only: a page or two, where DescribeInstanceTypes would
    # send every type's whole description (megabytes) to read one field of each.
    names: list[str] = []
    pages = call(lambda: list(ec2.get_paginator("describe_instance_type_offerings").paginate(LocationType="region")))
    for page in pages:
        names += [t["InstanceType"] for t in page["InstanceTypeOfferings"]]
    names = [n for n in names if image_pinned or on_base(n)]
    close = difflib.get_close_matches(instance_type, names, n=1, cutoff=0.6)
    raise ConfigError(
        f"unknown instance type {instance_type!r} in {aws.region}",
        f"Did you mean {close[0]!r}?" if close else f"GPU types: {suggested_types()}",
    )


def architecture(info: dict[str, Any]) -> str:
    """The architecture an image for this type must have (x86_64 where the type runs both)."""
    archs = info.get("ProcessorInfo", {}).get("SupportedArchitectures", ["x86_64"])
    return "x86_64" if "x86_64" in archs else archs[0]


def zones_offering(aws: Aws, instance_type: str) -> list[str]:
    res = aws.recent(("DescribeInstanceTypeOfferings", instance_type), lambda: call(
        aws.ec2().describe_instance_type_offerings,
        LocationType="availability-zone",
        Filters=[{"Name": "instance-type", "Values": [instance_type]}],
    ))
    return sorted({o["Location"] for o in res["InstanceTypeOfferings"]})


def spot_prices(aws: Aws, instance_type: str) -> dict[str, float]:
    """Zone -> latest Linux spot $/h; empty when the type has no spot offering here."""
    res = aws.recent(("DescribeSpotPriceHistory", instance_type), lambda: call(
        aws.ec2().describe_spot_price_history,
        InstanceTypes=[instance_type],
        ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"],
        StartTime=dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=6),
    ))
    latest: dict[str, tuple[Any, float]] = {}
    for item in res.get("SpotPriceHistory", []):
        zone, ts, price = item.get("AvailabilityZone"), item.get("Timestamp"), float(item["SpotPrice"])
        if zone and (zone not in latest or (ts and latest[zone][0] and ts > latest[zone][0])):
            latest[zone] = (ts, price)
    return {z: p for z, (_, p) in latest.items()}


def no_spot_offering(instance_type: str, region: str) -> CloudError:
    return CloudError(f"{instance_type} has no spot offering in {region}",
                      "Launch it on-demand (--on-demand), or let gpuctl fall back (--fallback-on-demand).")


def refuse_unmeetable_cap(instance_type: str, region: str, prices: dict[str, float], max_price: float | None) -> None:
    """A spot cap under the current price in every zone could only fail zone after zone (or bill
    on-demand), after the key pair and group were made: refused first, naming the cheapest zone."""
    if not max_price or not prices:
        return
    zone, cheapest = min(prices.items(), key=lambda kv: kv[1])
    if cheapest > max_price:
        raise ConfigError(
            f"--max-price ${max_price:.4f}/h is under the spot price of {instance_type} in every zone of {region} "
            f"(cheapest: ${cheapest:.4f}/h in {zone})",
            f"Raise it to at least {cheapest:.4f} (setting `aws.max_price`), leave it out (the cap is then the "
            "on-demand price), or launch --on-demand.")


def _region_name(aws: Aws) -> str | None:
    """'us-east-1' -> 'US East (N. Virginia)', the Price List API's location, from botocore's data."""
    data = aws.session._session.get_data("endpoints")  # shipped with botocore, no network
    for partition in data.get("partitions", []):
        region = partition.get("regions", {}).get(aws.region)
        if region:
            return region.get("description", "").replace("Europe", "EU")
    return None


def on_demand_price(aws: Aws, instance_type: str, cache_dir: Path) -> tuple[float, str]:
    """($/h, source): the Price List API (cached a day), else the dated built-in table."""
    cache = cache_dir / f"on-demand-{aws.region}-{instance_type}.json"
    try:
        cached = json.loads(cache.read_text())
        if time.time() - cached["at"] < 86400:
            return cached["usd"], cached["source"] + " (cached)"
    except (OSError, ValueError, KeyError):
        pass
    usd = _price_list(aws, instance_type)
    if usd is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"at": time.time(), "usd": usd, "source": "AWS Price List API"}))
        return usd, "AWS Price List API"
    if instance_type in ON_DEMAND_USD:
        return ON_DEMAND_USD[instance_type], f"built-in table ({PRICE_TABLE_DATE}, us-east-1)"
    return 0.0, "unknown (no Price List API answer and not in the built-in table)"


def _price_list(aws: Aws, instance_type: str) -> float | None:

    location = _region_name(aws)
    if not location:
        return None
    try:
        # The API lives in a few regions only. One try and one retry: the dated table answers
        # otherwise, and four backed-off retries of a failing Price List held every `up` ~10 s.
        pricing = aws.client("pricing", "us-east-1", retries=1)
        res = pricing.get_products(
            ServiceCode="AmazonEC2",
            Filters=[
                {"Type": "TERM_MATCH", "Field": k, "Value": v}
                for k, v in (
                    ("instanceType", instance_type), ("location", location), ("operatingSystem", "Linux"),
                    ("tenancy", "Shared"), ("preInstalledSw", "NA"), ("capacitystatus", "Used"),
                )
            ],
            MaxResults=10,
        )
        for raw in res.get("PriceList", []):
            product = json.loads(raw) if isinstance(raw, str) else raw
            for term in product.get("terms", {}).get("OnDemand", {}).values():
                for dim in term.get("priceDimensions", {}).values():
                    usd = float(dim.get("pricePerUnit", {}).get("USD", 0))
                    if usd > 0:
                        return usd
    except aws_errors() + (ValueError,):
        return None
    return None

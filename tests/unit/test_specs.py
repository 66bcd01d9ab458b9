"""Cluster specs: each provider's class holds its own fields and answers what the use cases ask
(ops/ never reads a provider's fields); the ledger's JSON reads back as the right class."""

import pytest
from pydantic import ValidationError

from gpuctl.model.records import ClusterRecord
from gpuctl.model.specs import AwsSpec, ClusterSpec, LocalSpec, SshSpec, parse_spec, spec_fields


def test_each_spec_reads_back_as_its_providers_class():
    for spec in (AwsSpec(name="a", market="spot", region="eu-west-1"), SshSpec(name="s", hosts=("me@box",)),
                 LocalSpec(name="l", usd_per_hour=1.0), ClusterSpec(name="f", provider="fake")):
        back = parse_spec(spec.model_dump_json())
        assert type(back) is type(spec) and back == spec
        record = ClusterRecord(id=1, name=spec.name, provider=spec.provider, state="up", created_at=1.0,
                               spec=spec.model_dump())
        assert type(record.spec) is type(spec)


def test_a_provider_keeps_its_fields_to_itself():
    # Bad inputs: another provider's field, a provider's class told another provider.
    with pytest.raises(ValidationError, match="region"):
        LocalSpec(name="l", region="eu-west-1")
    with pytest.raises(ValidationError, match="hosts"):
        parse_spec({"name": "a", "provider": "aws", "hosts": ["me@box"]})
    with pytest.raises(ValidationError):
        SshSpec(name="s", provider="aws")
    assert "market" in spec_fields("aws") and "market" not in spec_fields("ssh") | spec_fields("local")
    assert spec_fields("fake") == set(ClusterSpec.model_fields)


def test_what_the_use_cases_ask_of_a_spec():
    spot = AwsSpec(name="a", market="spot", region="eu-west-1", profile="p", checkpoints="s3", store_id="x1",
                   disk_gb=80, imds_endpoint="http://169.254.169.254")
    assert spot.interruptible and spot.scope == "eu-west-1" and spot.store_place == "a.x1"
    assert spot.store_key == ("aws", "eu-west-1", "p") and spot.billed_storage_gb == 80
    assert spot.metadata_endpoint == "http://169.254.169.254" and spot.checkpoint_hint == ""
    assert spot.on_demand_fallback().fallback_on_demand and not spot.fallback_on_demand
    kept_on_disk = AwsSpec(name="a", checkpoints="instance")
    assert "aws.checkpoints" in kept_on_disk.checkpoint_hint and not kept_on_disk.interruptible
    for other in (SshSpec(name="s", hosts=("me@box",)), LocalSpec(name="l")):
        assert not other.interruptible and other.scope is None and other.store_place == other.name
        assert other.store_key is None and other.billed_storage_gb == 0 and other.metadata_endpoint is None
        assert other.on_demand_fallback() is other and other.access_fields == frozenset()
    assert "hosts" in SshSpec.launch_fields and {"region", "market"} <= AwsSpec.launch_fields
    assert AwsSpec.access_fields == {"ssh_cidr"} and "hosts" not in LocalSpec.launch_fields

"""The aws provider's pure parts: error translation, quota hints, waiting, the user data script,
and the Price List parse and cache (botocore's Stubber: moto has no Price List API)."""

import gzip
import subprocess
import time

import pytest
from botocore.exceptions import ClientError, NoCredentialsError

from gpuctl.errors import CloudError, ConfigError, ExitCode
from gpuctl.provision.aws import catalog
from gpuctl.provision.aws.launch import LaunchPlan, run_params
from gpuctl.provision.aws.session import quota_hint, translate
from gpuctl.provision.aws.userdata import hard_cap_script
from gpuctl.retry import TimedOut, poll
from tests.waits import FakeClock


def client_error(code, message, op="RunInstances"):
    return ClientError({"Error": {"Code": code, "Message": message}}, op)


def test_unauthorized_names_the_iam_action():
    msg = ("You are not authorized to perform this operation. User: arn:aws:iam::123:user/bob is not "
           "authorized to perform: ec2:RunInstances on resource: arn:aws:ec2:us-east-1:123:instance/*")
    err = translate(client_error("UnauthorizedOperation", msg))
    assert isinstance(err, CloudError) and err.exit_code == ExitCode.CLOUD
    assert err.message == "not allowed to call ec2:RunInstances" and "Grant ec2:RunInstances" in err.hint
    # Without the action in the message, the operation gpuctl called names it.
    assert translate(client_error("UnauthorizedOperation", "denied"), "CreateSecurityGroup").message == \
        "not allowed to call ec2:CreateSecurityGroup"


@pytest.mark.parametrize("code", ["ExpiredToken", "RequestExpired", "ExpiredTokenException"])
def test_expired_token(code):
    err = translate(client_error(code, "The security token included in the request is expired"))
    assert err.message == "your AWS session token has expired" and "aws sso login" in err.hint


def test_no_credentials_and_unknown_codes():
    assert translate(NoCredentialsError()).message == "no AWS credentials found"
    err = translate(client_error("InvalidAMIID.NotFound", "The image id '[ami-1]' does not exist"))
    assert "AMI not found" in err.message
    other = translate(client_error("SomethingNew", "odd"), "RunInstances")
    assert other.message == "AWS RunInstances failed: SomethingNew: odd"


def test_an_unreachable_endpoint_doubts_the_region_only_where_it_has_one():
    from botocore.exceptions import EndpointConnectionError

    def down(url):
        return EndpointConnectionError(endpoint_url=url)

    assert "the region exists" in translate(down("https://ec2.us-east-9.amazonaws.com/")).hint
    for service, name in (("ce", "Cost Explorer"), ("budgets", "AWS Budgets")):
        err = translate(down(f"https://{service}.us-east-1.amazonaws.com/"), "GetCostAndUsage", service)
        assert err.message.startswith("cannot reach AWS") and f"{name} answers at us-east-1" in err.hint
        assert "region exists" not in err.hint


def test_quota_hints_by_family_and_market():
    assert '"All G and VT Spot Instance Requests"' in quota_hint("g5.xlarge", "spot")
    assert '"Running On-Demand G and VT instances"' in quota_hint("g4dn.xlarge", "on-demand")
    assert '"All P Spot Instance Requests"' in quota_hint("p3.2xlarge", "spot")
    assert '"Running On-Demand Standard instances"' in quota_hint("c5.large", "on-demand")


def test_poll_backs_off_and_times_out_saying_what_it_last_saw():
    calls, waits, clock = [], [], FakeClock()
    with pytest.raises(TimedOut) as info:
        poll(lambda: calls.append(1), 1.5, on_wait=lambda waited, last: waits.append(last), describe=lambda: "no moon",
             clock=clock)
    assert str(info.value) == "timed out after 1s (no moon)"
    assert len(calls) == 2  # 1 s, then a 2 s wait would pass the deadline
    assert waits == ["no moon"]
    assert poll(lambda: "done", 1, clock=clock) == "done"
    assert poll(lambda: 0, 1, clock=clock) == 0  # a falsy answer that is not None is an answer


def test_user_data_is_valid_bash_and_arms_the_cap():
    script = hard_cap_script(6.5)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "OnBootSec=390min" in script and "shutdown -h +390" in script
    assert "/var/lib/gpuctl/hard-cap" in script


def test_run_params_are_safe_for_both_markets():
    plan = LaunchPlan(cluster="c", owner="o", instance_type="g5.xlarge", image_id="ami-1", root_device="/dev/sda1",
                      key_name="k", security_group="sg-1", subnets={"us-east-1a": "subnet-1"}, market="spot",
                      max_price=0.5, fallback_on_demand=False, disk_gb=50, user_data="#!/bin/bash", token_seed="t")
    spot = run_params(plan, "us-east-1a", "spot")
    assert spot["InstanceMarketOptions"] == {"MarketType": "spot", "SpotOptions": {
        "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate", "MaxPrice": "0.5000"}}
    ondemand = run_params(plan, "us-east-1a", "on-demand")
    assert "InstanceMarketOptions" not in ondemand
    for p in (spot, ondemand):
        assert p["MetadataOptions"]["HttpTokens"] == "required"
        assert p["InstanceInitiatedShutdownBehavior"] == "terminate"
        assert p["BlockDeviceMappings"][0]["Ebs"] == {"VolumeSize": 50, "VolumeType": "gp3", "Encrypted": True,
                                                      "DeleteOnTermination": True}
        assert {t["ResourceType"] for t in p["TagSpecifications"]} == {"instance", "volume"}
    assert spot["ClientToken"] != ondemand["ClientToken"]
    assert run_params(plan, "us-east-1a", "spot")["ClientToken"] == spot["ClientToken"]  # a retry reuses it


def _plan(**changes):
    base = dict(cluster="c", owner="o", instance_type="g5.xlarge", image_id="ami-1", root_device="/dev/sda1",
                key_name="k", security_group="sg-1", subnets={"us-east-1a": "subnet-1"}, market="spot",
                max_price=0.0, fallback_on_demand=False, disk_gb=50, user_data="#!/bin/bash", token_seed="t")
    return LaunchPlan(**{**base, **changes})


def test_run_params_of_each_node_carry_its_rank_its_own_token_and_the_placement_group():
    plan = _plan(nodes=3, placement_group="gpuctl-c-0123abcd")
    params = [run_params(plan, "us-east-1a", "spot", node) for node in range(3)]
    for node, p in enumerate(params):
        assert p["MinCount"] == p["MaxCount"] == 1
        for spec in p["TagSpecifications"]:  # on the instance and its volume, at creation
            assert {"Key": "gpuctl:node", "Value": str(node)} in spec["Tags"]
        assert p["Placement"] == {"GroupName": "gpuctl-c-0123abcd"}
        assert p["MetadataOptions"]["HttpTokens"] == "required" and p["BlockDeviceMappings"][0]["Ebs"]["Encrypted"]
    assert len({p["ClientToken"] for p in params}) == 3
    assert run_params(plan, "us-east-1a", "spot", 1)["ClientToken"] == params[1]["ClientToken"]  # a rerun: the same
    assert run_params(plan, "us-east-1a", "spot", 1, generation=1)["ClientToken"] != params[1]["ClientToken"]
    assert "Placement" not in run_params(_plan(), "us-east-1a", "spot")


def test_a_client_token_used_by_a_rolled_back_node_is_replaced():
    from types import SimpleNamespace

    import boto3
    from botocore.stub import Stubber

    from gpuctl.provision.aws import nodes

    ec2 = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y")
    aws = SimpleNamespace(ec2=lambda region=None: ec2, region="us-east-1", clock=FakeClock())
    sent, seen = [], []
    ec2.meta.events.register("provide-client-params.ec2.RunInstances", lambda params, **_: sent.append(params["ClientToken"]))
    with Stubber(ec2) as stub:
        stub.add_client_error("run_instances", "IdempotentInstanceTerminated", "token of a terminated instance")
        stub.add_response("run_instances", {"Instances": [{"InstanceId": "i-old", "State": {"Name": "terminated"}}]})
        stub.add_response("run_instances", {"Instances": [{"InstanceId": "i-new", "State": {"Name": "pending"}}]})
        (inst,), market = nodes.launch_nodes(aws, _plan(), seen.append)
    assert inst["InstanceId"] == "i-new" and market == "spot" and len(set(sent)) == 3
    assert sum("asking anew" in line for line in seen) == 2


def test_reuse_takes_a_whole_cluster_by_rank_or_nothing():
    from gpuctl.provision.aws import nodes

    def inst(iid, rank=None):
        return {"InstanceId": iid, "Tags": [] if rank is None else [{"Key": "gpuctl:node", "Value": str(rank)}]}

    assert [i["InstanceId"] for i in nodes.reusable([inst("i-b", 1), inst("i-a", 0)], 2, "c")] == ["i-a", "i-b"]
    assert nodes.reusable([inst("i-old")], 1, "c")[0]["InstanceId"] == "i-old"  # made before ranks: node 0
    with pytest.raises(CloudError, match="where 1 was asked"):
        nodes.reusable([inst("i-a", 0), inst("i-b", 1)], 1, "c")
    with pytest.raises(CloudError, match="has 1 of its 2 nodes left") as info:
        nodes.reusable([inst("i-b", 1)], 2, "c")
    assert "gpuctl down c -y" in info.value.hint
    with pytest.raises(CloudError):  # two claim rank 0: not a cluster gpuctl made
        nodes.reusable([inst("i-a", 0), inst("i-b", 0)], 2, "c")


class _FakeAws:
    """Just enough of session.Aws for catalog.on_demand_price: a real boto3 session and client."""

    def __init__(self):
        import boto3

        self.session = boto3.session.Session(aws_access_key_id="x", aws_secret_access_key="y", region_name="eu-west-1")
        self.region = "eu-west-1"
        self.pricing = self.session.client("pricing", region_name="us-east-1")

    def client(self, service, region=None, retries=5):
        assert service == "pricing"
        return self.pricing


def test_price_list_answer_is_parsed_and_cached_a_day(tmp_path):
    import json

    from botocore.stub import ANY, Stubber

    aws = _FakeAws()
    product = {"product": {"attributes": {"instanceType": "g5.xlarge"}}, "terms": {"OnDemand": {"X.Y": {
        "priceDimensions": {"X.Y.Z": {"unit": "Hrs", "pricePerUnit": {"USD": "1.1230000000"}}}}}}}
    with Stubber(aws.pricing) as stub:
        stub.add_response("get_products", {"PriceList": [json.dumps(product)]},
                          {"ServiceCode": "AmazonEC2", "Filters": ANY, "MaxResults": 10})
        assert catalog.on_demand_price(aws, "g5.xlarge", tmp_path) == (1.123, "AWS Price List API")
        stub.assert_no_pending_responses()
        # Within a day the cache answers; the stub has no more responses, so a call would fail.
        assert catalog.on_demand_price(aws, "g5.xlarge", tmp_path) == (1.123, "AWS Price List API (cached)")
    cache = tmp_path / "on-demand-eu-west-1-g5.xlarge.json"
    data = json.loads(cache.read_text())
    data["at"] = time.time() - 90000
    cache.write_text(json.dumps(data))
    with Stubber(aws.pricing) as stub:
        stub.add_client_error("get_products", "AccessDeniedException", "no pricing:GetProducts")
        assert catalog.on_demand_price(aws, "g5.xlarge", tmp_path) == (1.006, "built-in table (2025-01, us-east-1)")
    assert catalog._region_name(aws) == "EU (Ireland)"


def test_unknown_type_not_in_table_says_unknown(tmp_path):
    from botocore.stub import Stubber

    aws = _FakeAws()
    with Stubber(aws.pricing) as stub:
        stub.add_client_error("get_products", "ThrottlingException", "slow down")
        usd, source = catalog.on_demand_price(aws, "zz9.huge", tmp_path)
    assert usd == 0.0 and source.startswith("unknown")


def test_config_error_for_bad_cidr_setting(tmp_path):
    from gpuctl.config.load import load_settings

    with pytest.raises(ConfigError, match="aws.ssh_cidr"):
        load_settings(env={"GPUCTL_AWS__SSH_CIDR": "1.2.3.4/33"}, cwd=tmp_path)


def test_ssh_open_wider_than_a_16_gets_the_warning():
    """Before, only 0.0.0.0/0 was warned of; 0.0.0.0/1 is half the internet."""
    from gpuctl.provision.aws.access import ssh_cidr

    assert ssh_cidr("0.0.0.0/0", detect=False) == ("0.0.0.0/0", "the whole internet (0.0.0.0/0)")
    cidr, wide = ssh_cidr("0.0.0.0/1", detect=False)
    assert cidr == "0.0.0.0/1" and wide == "2,147,483,648 addresses (0.0.0.0/1)"
    assert ssh_cidr("10.0.0.0/15", detect=False)[1] == "131,072 addresses (10.0.0.0/15)"
    assert ssh_cidr("10.1.0.0/16", detect=False) == ("10.1.0.0/16", None)  # a /16 is the widest said nothing of
    assert ssh_cidr("203.0.113.7/32", detect=False) == ("203.0.113.7/32", None)
    assert ssh_cidr("::/0", detect=False)[1] == "the whole internet (::/0)"
    assert "(2001:db8::/32)" in ssh_cidr("2001:db8::/32", detect=False)[1]
    assert ssh_cidr("2001:db8::/48", detect=False)[1] is None  # one site's allocation


def _ec2():
    import boto3

    return boto3.client("ec2", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y")


def test_only_not_found_means_an_instance_is_gone():
    """moto cannot fail a DescribeInstances on demand: the Stubber plays AWS's answers. A
    throttled or unauthorized answer must never close a cluster that still runs;
    InvalidInstanceID.NotFound for one of two ids is resolved id by id."""
    from botocore.stub import Stubber

    from gpuctl.model.records import InstanceRecord
    from gpuctl.provision.aws import lifecycle

    ec2 = _ec2()
    aws = type("A", (), {"ec2": lambda self: ec2})()
    recs = [InstanceRecord(id=i, cluster="c", state="running", launched_at=1.0, workdir="/w", region="us-east-1")
            for i in ("i-1", "i-2")]
    with Stubber(ec2) as stub:
        stub.add_client_error("describe_instances", "RequestLimitExceeded", "slow down")
        with pytest.raises(CloudError):
            lifecycle.reconcile(lambda region: aws, recs)
    running = {"Reservations": [{"Instances": [{"InstanceId": "i-2", "State": {"Name": "running", "Code": 16}}]}]}
    with Stubber(ec2) as stub:
        stub.add_client_error("describe_instances", "InvalidInstanceID.NotFound", "i-1 is gone")
        stub.add_client_error("describe_instances", "InvalidInstanceID.NotFound", "i-1 is gone")
        stub.add_response("describe_instances", running)
        gone, live = lifecycle.reconcile(lambda region: aws, recs)
    assert gone.state == "terminated" and gone.state_reason == "no longer known to EC2"
    assert live.state == "running"


def _first_run(home, barrier, out):
    from gpuctl.provision.aws.access import owner_id

    barrier.wait()  # every process asks at once, as 12 `gpuctl up` started together on a new home
    out.put(owner_id(home))


def test_simultaneous_first_runs_agree_on_one_owner_id(tmp_path):
    """Before the fix 12 processes got up to 4 ids a round here (2 CPUs; 2-7 were seen on bigger
    machines), and resources tagged with a losing id became another owner's. Five rounds, so one
    lucky round cannot hide the race."""
    import multiprocessing

    from gpuctl.provision.aws.access import owner_id

    ctx = multiprocessing.get_context("fork")
    for n in range(5):
        home = tmp_path / f"home{n}"
        barrier, out = ctx.Barrier(12), ctx.Queue()
        procs = [ctx.Process(target=_first_run, args=(home, barrier, out)) for _ in range(12)]
        for p in procs:
            p.start()
        ids = [out.get(timeout=30) for _ in procs]
        for p in procs:
            p.join(10)
        assert set(ids) == {(home / "owner").read_text().strip()}, f"round {n}: {len(set(ids))} ids"
        assert (home / "owner").stat().st_mode & 0o777 == 0o600
        assert [f.name for f in home.iterdir()] == ["owner"]  # no temp file left behind
        assert owner_id(home) == ids[0]


def test_an_empty_owner_file_is_an_error_not_an_empty_owner(tmp_path):
    from gpuctl.provision.aws.access import owner_id

    (tmp_path / "owner").write_text("\n")
    with pytest.raises(ConfigError, match="is empty") as info:
        owner_id(tmp_path)
    assert "Remove" in info.value.hint


def test_regions_to_search_are_the_enabled_ones_of_the_partition():
    """`status --all` searches every region DescribeRegions lists, except one it marks not opted
    in (moto lists those too; AWS does not) and one of another partition (the Stubber answers)."""
    import boto3
    from botocore.stub import Stubber

    from gpuctl.provision.aws import inventory

    class _Aws:
        session = boto3.session.Session(aws_access_key_id="x", aws_secret_access_key="y", region_name="us-east-1")
        _ec2 = session.client("ec2")

        def ec2(self, region=None):
            return self._ec2

    aws = _Aws()
    with Stubber(aws._ec2) as stub:
        stub.add_response("describe_regions", {"Regions": [
            {"RegionName": "us-east-1", "OptInStatus": "opt-in-not-required"},
            {"RegionName": "af-south-1", "OptInStatus": "opted-in"},
            {"RegionName": "me-central-1", "OptInStatus": "not-opted-in"},
            {"RegionName": "eu-west-1"},  # no status given: enabled
            {"RegionName": "cn-north-1", "OptInStatus": "opt-in-not-required"},
        ]})
        assert inventory.regions(aws) == ["af-south-1", "eu-west-1", "us-east-1"]


def test_the_user_data_with_the_watchdogs_code_fits_ec2s_16_kb():
    """The watchdog's files (gpuctl_protocol.WATCHDOG_FILES) ride in the user data, gzipped: a
    payload that grows past EC2's 16 KB fails every `up` on aws (tests/aws.py checks it in moto;
    this says so in the fast tier)."""
    from gpuctl.provision.aws.userdata import boot_script

    guard = {"idle_s": 1800.0, "check_interval_s": 60.0, "gpu_idle_percent": 5.0, "on_fire": "poweroff",
             "poweroff_command": "sudo shutdown -h now"}
    raw = boot_script(8.0, guard, "ubuntu", "~/gpuctl")
    assert len(raw) <= 16384
    script = gzip.decompress(raw).decode()
    # The settings' limits are written even where they equal the watchdog's defaults: `guard show`
    # reads them back before the first `train`.
    assert '"on_fire": "poweroff"' in script and '"poweroff_command": "sudo shutdown -h now"' in script


def test_the_user_datas_watchdog_is_the_same_code_without_comments():
    """The user data carries the watchdog's files lean (comments out, docstrings empty): their
    syntax trees are the originals' but for the docstrings, and a string that spans lines keeps
    every character (blank lines and trailing spaces are its value)."""
    import ast

    from gpuctl.payloads.gpuctl_protocol import WATCHDOG_FILES
    from gpuctl.provision.aws.shipped import _docstrings, lean
    from gpuctl.provision.aws.userdata import PAYLOADS

    def tree(source: str) -> str:
        parsed = ast.parse(source)
        for doc in _docstrings(parsed):
            doc.value = ""
        return ast.dump(parsed)

    whole = lean_total = 0
    for name in WATCHDOG_FILES:
        source = (PAYLOADS / name).read_text()
        shipped = lean(source)
        assert tree(shipped) == tree(source), name
        assert "#" not in "".join(ln for ln in shipped.splitlines() if ln.lstrip().startswith("#")), name
        whole, lean_total = whole + len(source), lean_total + len(shipped)
    assert lean_total < whole * 0.8  # comments and docstrings are what it leaves out

    tricky = ('"""Doc.\n\nMore."""\nimport os  # why\n\n\nS = """a\n\n  b  \n# not a comment\n"""\n\n'
              'def f():\n    """Only a docstring."""\n\n\ndef g():\n    """Non-ASCII: é ü."""\n    return 1\n\n\nclass C:\n    # a comment alone\n    x = "#" + f"{1}"  # tail\n')
    out = lean(tricky)
    assert tree(out) == tree(tricky)
    assert 'S = """a\n\n  b  \n# not a comment\n"""' in out
    assert "why" not in out and "a comment alone" not in out and "tail" not in out and "Doc." not in out
    namespace: dict = {}
    exec(compile(out, "<lean>", "exec"), namespace)
    assert namespace["S"] == "a\n\n  b  \n# not a comment\n" and namespace["C"].x == "#1"

"""What the aws provider's boto3 sessions cost: one session per region per command, one
botocore loader per process (each new session parsed EC2's service model again, ~70 ms), and a
Price List that fails is asked twice, not six times with backoff (it held every `up` ~10 s
before the dated table answered). A local HTTP server stands for an endpoint that fails: what is
counted is the requests boto3 really sends."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gpuctl.model.specs import AwsSpec
from gpuctl.provision.aws import catalog
from gpuctl.provision.aws.provider import AwsProvider
from gpuctl.provision.aws.session import Aws


@pytest.fixture
def creds(monkeypatch, tmp_path):
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                 "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                 "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)
    for var in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def failing_endpoint(monkeypatch):
    """An endpoint that answers every request 500 (a Price List that is down); the requests seen."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            seen.append(self.headers.get("X-Amz-Target", ""))
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(500)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
    yield seen
    server.shutdown()
    server.server_close()


def test_a_failing_price_list_is_asked_twice_then_the_table_answers(creds, failing_endpoint, tmp_path):
    usd, source = catalog.on_demand_price(Aws("us-east-1"), "g5.xlarge", tmp_path)
    assert usd == catalog.ON_DEMAND_USD["g5.xlarge"] and source.startswith("built-in table")
    assert len(failing_endpoint) == 2 and all(t.endswith("GetProducts") for t in failing_endpoint)


def test_one_session_per_region_per_command_and_one_loader_for_all(creds, tmp_path):
    p = AwsProvider(Path(tmp_path), AwsSpec(name="c", region="us-east-1"))
    assert p.aws() is p.aws("us-east-1") and p.aws("us-west-2") is not p.aws()
    assert p.aws().ec2() is p.aws().ec2()
    other = AwsProvider(Path(tmp_path), AwsSpec(name="c", region="us-east-1"))
    assert other.aws() is not p.aws()  # a session per command: nothing outlives it
    loaders = {id(a.session._session.get_component("data_loader")) for a in (p.aws(), p.aws("us-west-2"), other.aws())}
    assert len(loaders) == 1


def test_clients_of_every_session_and_region_share_their_class_and_model_and_others_build_their_own(creds, tmp_path):
    import boto3

    a, b = Aws("us-east-1"), Aws("us-west-2")
    assert type(a.ec2()) is type(b.ec2()) and a.ec2() is not b.ec2()
    assert a.ec2().meta.service_model is b.ec2().meta.service_model
    assert a.ec2().meta.region_name == "us-east-1" and b.ec2().meta.region_name == "us-west-2"
    s3 = a.client("s3")
    assert type(s3) is type(b.client("s3")) and hasattr(s3, "upload_file")  # boto3's injected methods stay
    assert type(s3) is not type(a.ec2())
    plain = boto3.session.Session(region_name="us-east-1").client("ec2")  # not a session of ours
    assert type(plain) is not type(a.ec2()) and hasattr(plain, "describe_instances")
    assert plain.meta.service_model is not a.ec2().meta.service_model


# Events botocore's built-in handlers answer, across services and stages of a call.
BUILT_IN_EVENTS = ("before-parameter-build.ec2.RunInstances", "needs-retry.ec2.DescribeInstances",
                   "before-sign.s3.PutObject", "before-call.s3.PutObject", "choose-signer.s3",
                   "provide-client-params.s3.GetObject", "after-call.ec2.DescribeInstances",
                   "creating-client-class.s3", "docs.request-example.ec2")


def test_every_session_starts_with_botocores_built_in_handlers_and_keeps_its_own_to_itself(creds):
    import botocore.session

    from gpuctl.provision.aws.session import _botocore_session

    def handlers(session):  # botocore has no public listing: its emitter's own lookup
        return [[getattr(h, "__qualname__", repr(h)) for h in session._original_handler._handlers.prefix_search(ev)]
                for ev in BUILT_IN_EVENTS]

    plain, first, second = botocore.session.get_session(), _botocore_session(), _botocore_session()
    assert handlers(first) == handlers(second) == handlers(plain) and sum(map(len, handlers(plain))) > 5
    called: list[str] = []
    first.register("gpuctl-test.ec2", lambda **kw: called.append("first"))
    for session in (second, _botocore_session()):
        session.get_component("event_emitter").emit("gpuctl-test.ec2.RunInstances")
    assert called == [] and handlers(second) == handlers(plain)
    first.get_component("event_emitter").emit("gpuctl-test.ec2.RunInstances")
    assert called == ["first"]


def test_clients_share_the_renaming_of_events_and_still_rename_them_as_botocore_does(creds):
    from botocore.hooks import EventAliaser, HierarchicalEmitter

    a, b = Aws("us-east-1").ec2().meta.events, Aws("us-west-2").client("s3").meta.events
    assert a._alias_name_cache is b._alias_name_cache  # one memo for botocore's own table
    assert a._alias_event_name("before-call.autoscaling.DescribeTags") == "before-call.auto-scaling.DescribeTags"
    assert b._alias_event_name("before-call.runtime.sagemaker.InvokeEndpoint") == \
        "before-call.sagemaker-runtime.InvokeEndpoint"
    assert b._alias_event_name("before-call.ec2.RunInstances") == "before-call.ec2.RunInstances"
    own = EventAliaser(HierarchicalEmitter(), {"ec2": "elastic-compute"})  # another table: a memo of its own
    assert own._alias_name_cache is not a._alias_name_cache
    assert own._alias_event_name("before-call.ec2.RunInstances") == "before-call.elastic-compute.RunInstances"
    assert a._alias_event_name("before-call.ec2.RunInstances") == "before-call.ec2.RunInstances"


def test_a_recent_answer_serves_for_a_minute_and_an_error_is_never_kept(creds, monkeypatch):
    from gpuctl.provision.aws import session

    now = [1000.0]
    monkeypatch.setattr(session.time, "monotonic", lambda: now[0])
    aws, fetched = Aws("us-east-1"), []

    def fetch():
        fetched.append(now[0])
        if len(fetched) == 1:
            raise RuntimeError("throttled")
        return len(fetched)

    with pytest.raises(RuntimeError):
        aws.recent(("DescribeSpotPriceHistory", "g5.xlarge"), fetch)
    assert aws.recent(("DescribeSpotPriceHistory", "g5.xlarge"), fetch) == 2  # the error was not kept
    now[0] += session.RECENT_S - 1
    assert aws.recent(("DescribeSpotPriceHistory", "g5.xlarge"), fetch) == 2
    assert aws.recent(("DescribeSpotPriceHistory", "g6.xlarge"), fetch) == 3  # another question
    now[0] += 2  # a minute after the answer: a person took that long to say yes
    assert aws.recent(("DescribeSpotPriceHistory", "g5.xlarge"), fetch) == 4
    assert Aws("us-east-1").recent(("DescribeSpotPriceHistory", "g5.xlarge"), fetch) == 5  # another command


def test_a_built_in_handler_added_later_reaches_the_sessions_made_after_it(creds, monkeypatch):
    """moto's in-process mock adds its stubber to botocore's built-in handlers when imported; a
    session made after that must have it, whenever the copied set was registered."""
    from botocore import handlers as botocore_handlers

    from gpuctl.provision.aws.session import _botocore_session

    _botocore_session()  # the set is registered before the list grows
    called: list[str] = []
    monkeypatch.setattr(botocore_handlers, "BUILTIN_HANDLERS",
                        [*botocore_handlers.BUILTIN_HANDLERS, ("gpuctl-test.ec2", lambda **kw: called.append("late"))])
    _botocore_session().get_component("event_emitter").emit("gpuctl-test.ec2.RunInstances")
    assert called == ["late"]

"""boto3 sessions and clients, and the translation of botocore errors into gpuctl errors.

Credentials come only from boto3's own chain (profile, env, SSO); gpuctl never stores or copies
them. boto3 is imported here, lazily, and nowhere above `provision/`.
"""

from __future__ import annotations

import difflib
import re
import threading
import time
from typing import Any, Callable, TypeVar

from gpuctl.errors import CloudError, ConfigError, GpuctlError, NoCapacityError
from gpuctl.retry import REAL_CLOCK, Clock

T = TypeVar("T")

# Errors that mean "not here, try the next zone or market" rather than "stop".
CAPACITY_CODES = frozenset({
    "InsufficientInstanceCapacity",
    "InsufficientCapacity",
    "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity",
    "MaxSpotInstanceCountExceeded",
    "SpotMaxPriceTooLow",
    "InstanceLimitExceeded",
    "Unsupported",
    "VcpuLimitExceeded",
})
QUOTA_CODES = frozenset({"VcpuLimitExceeded", "MaxSpotInstanceCountExceeded", "InstanceLimitExceeded"})


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def error_message(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Message", "")) or str(exc)


def quota_hint(instance_type: str, market: str) -> str:
    """Which Service Quota to raise: EC2 counts vCPUs per instance-family group and market."""
    group = {"g": "G and VT", "v": "G and VT", "p": "P"}.get(instance_type[:1].lower(), "Standard")
    name = f"All {group} Spot Instance Requests" if market == "spot" else f"Running On-Demand {group} instances"
    return f'Raise the EC2 quota "{name}" (vCPUs) in the Service Quotas console for this region.'


def aws_errors() -> tuple[type[BaseException], ...]:
    """What botocore raises for a call that failed, in every shape: an error answer (ClientError,
    throttling and 5xx after their retries), no answer or a dropped connection (BotoCoreError), and
    an answer that is not the API's at all (ResponseParserError: an HTML page from a proxy)."""
    from botocore import exceptions as bx
    from botocore.parsers import ResponseParserError

    return (bx.ClientError, bx.BotoCoreError, ResponseParserError)


def _not_an_api_answer(http_response: Any, parsed: Any, model: Any, **_: Any) -> None:
    """A 200 whose body is an HTML page (a proxy's or a captive portal's) parses as an answer with
    nothing in it, and the caller's `res["Reservations"]` failed in gpuctl's own code. AWS's API
    answers always carry a request id; such a page has none: it is the parse error it is."""
    from botocore.parsers import ResponseParserError

    if getattr(http_response, "status_code", 0) != 200 or not isinstance(parsed, dict):
        return
    kind = str(getattr(http_response, "headers", {}).get("content-type", ""))
    if "html" in kind.lower() and not parsed.get("ResponseMetadata", {}).get("RequestId"):
        raise ResponseParserError(f"{model.name}: an HTML page answered with 200, not AWS's API")


GLOBAL_SERVICES = {"ce": "Cost Explorer", "budgets": "AWS Budgets", "iam": "IAM"}


def translate(exc: BaseException, action: str = "", service: str = "ec2") -> GpuctlError:
    """One botocore exception -> one gpuctl error with a hint. Unknown ones stay CloudErrors."""
    from botocore import exceptions as bx

    if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return CloudError(
            "no AWS credentials found",
            "Run `aws configure` or `aws sso login`, or set AWS_PROFILE (or pass --profile).",
        )
    if isinstance(exc, bx.ProfileNotFound):
        return ConfigError(f"AWS profile not found: {exc}", "List profiles with `aws configure list-profiles`.")
    if isinstance(exc, bx.NoRegionError):
        return ConfigError("no AWS region set", "Pass --region, set `[aws] region`, or export AWS_REGION.")
    if isinstance(exc, bx.TokenRetrievalError) or isinstance(exc, bx.SSOTokenLoadError):
        return CloudError(f"AWS SSO login needed: {exc}", "Run `aws sso login` (with --profile if you use one).")
    if isinstance(exc, bx.EndpointConnectionError):
        if service in GLOBAL_SERVICES:  # their one endpoint: no region of the user's to doubt
            return CloudError(f"cannot reach AWS: {exc}", f"Check the network ({GLOBAL_SERVICES[service]} answers at "
                                                          "us-east-1, whatever the clusters' region).")
        return CloudError(f"cannot reach AWS: {exc}", "Check the network, and that the region exists.")
    code = error_code(exc)
    msg = error_message(exc)
    if code in ("ExpiredToken", "ExpiredTokenException", "RequestExpired"):
        return CloudError("your AWS session token has expired", "Refresh it: `aws sso login`, or new temporary credentials.")
    if code in ("AuthFailure", "InvalidClientTokenId", "SignatureDoesNotMatch", "UnrecognizedClientException"):
        return CloudError(f"AWS rejected the credentials ({code})", "Check AWS_PROFILE / the access keys in use: `aws sts get-caller-identity`.")
    if code in ("UnauthorizedOperation", "AccessDenied", "AccessDeniedException"):
        m = re.search(r"perform: ([a-z0-9-]+:[A-Za-z0-9]+)", msg)
        perm = m.group(1) if m else (f"{service}:{action}" if action else f"the {service.upper()} action")
        return CloudError(f"not allowed to call {perm}", f"Grant {perm} to your IAM identity (see docs/aws-iam.md for the full list).")
    if code.startswith("InvalidAMIID"):
        return CloudError(f"AMI not found in this region: {msg}", "Check `[aws] image` (--image), or leave it empty to let gpuctl choose one (see `gpuctl image ls`).")
    return CloudError(f"AWS {action or 'call'} failed: {code or type(exc).__name__}: {msg}".rstrip(": "))


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call a boto3 client method; botocore errors become gpuctl errors named after the action."""
    try:
        return fn(*args, **kwargs)
    except aws_errors() as exc:
        raise translate(exc, getattr(fn, "__name__", "").title().replace("_", "")) from exc


def call_in(service: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`call` for another service than EC2: a refusal names `service:Action` (ce:GetCostAndUsage)."""
    try:
        return fn(*args, **kwargs)
    except aws_errors() as exc:
        raise translate(exc, getattr(fn, "__name__", "").title().replace("_", ""), service) from exc


WAITER_DELAY_S = 2
# How long a session's read of EC2's catalog serves again (Aws.recent): a question and the launch
# it leads to, not the minutes a person may take to answer it.
RECENT_S = 60.0


def wait_for(client: Any, waiter: str, timeout_s: float, what: str, hint: str, **params: Any) -> None:
    """Block on one of boto3's own waiters (e.g. instance_running), every WAITER_DELAY_S seconds
    for up to `timeout_s`; a timeout or a failure state becomes a CloudError naming `what`."""
    from botocore import exceptions as bx

    attempts = max(1, int(timeout_s // WAITER_DELAY_S))
    try:
        client.get_waiter(waiter).wait(WaiterConfig={"Delay": WAITER_DELAY_S, "MaxAttempts": attempts}, **params)
    except bx.WaiterError as exc:
        last = exc.last_response or {}
        if "Error" in last:
            raise translate(bx.ClientError(last, waiter), waiter) from exc
        reasons = [i.get("StateReason", {}).get("Message") or i["State"]["Name"]
                   for r in last.get("Reservations", []) for i in r.get("Instances", [])]
        why = f" ({'; '.join(reasons)})" if reasons else ""
        if "terminal failure state" in str(exc):
            raise CloudError(f"gave up waiting for {what}: it ended{why}", "Try again, or another zone or market.") from exc
        raise CloudError(f"timed out after {timeout_s:.0f}s waiting for {what}{why}", hint) from exc
    except aws_errors() as exc:
        raise translate(exc, waiter) from exc


_LOADER: list[Any] = []  # botocore's data loader, shared by every session of this process
# (how many built-in handlers botocore lists, an emitter holding them): copied for each session
_HANDLERS: list[tuple[int, Any]] = []
# Built for that loader once per (service, API version): service models and client classes.
_SHARED: dict[tuple[str, str, str], Any] = {}
_SHARED_LOCK = threading.Lock()


def _botocore_session() -> Any:
    """A new botocore session that reads AWS's service models through the process's one loader:
    each session would parse them again (EC2's alone is megabytes of JSON, ~70 ms a session).
    Its event handlers start as a copy of botocore's built-in ones, registered once: registering
    them (~150, each event name aliased and each handler's signature inspected) took ~12 ms a
    session, and a command makes one or more; they are module-level functions, alike in every
    session, and a copied emitter takes later registrations for itself alone."""
    import copy

    import botocore.session
    from botocore.handlers import BUILTIN_HANDLERS

    with _SHARED_LOCK:
        # Registered anew if the list grew since (a library may add to it, as moto's mock does).
        if not _HANDLERS or _HANDLERS[0][0] != len(BUILTIN_HANDLERS):
            from botocore.hooks import HierarchicalEmitter

            template = HierarchicalEmitter()
            botocore.session.Session(event_hooks=template)  # registers the built-in handlers there
            _HANDLERS[:] = [(len(BUILTIN_HANDLERS), template)]
        handlers = copy.copy(_HANDLERS[0][1])
    handlers._lookup_cache = {}  # a copy shares its original's memo of lookups: this one starts its own
    session = botocore.session.Session(event_hooks=handlers, include_builtin_handlers=False)
    if _LOADER:
        session.register_component("data_loader", _LOADER[0])
    else:
        _LOADER.append(session.get_component("data_loader"))
        _share_service_parts()
    return session


def _once(kind: str, service: str, version: Any, build: Any) -> Any:
    key = (kind, service, str(version))
    with _SHARED_LOCK:
        made = _SHARED.get(key)
    if made is None:
        made = build()
        with _SHARED_LOCK:
            made = _SHARED.setdefault(key, made)
    return made


def _share_service_parts() -> None:
    """botocore builds two things anew for every client that depend only on the service's model:
    the ServiceModel (whose endpoint-discovery check walks all ~700 EC2 operations, ~60 ms) and the
    client's class (a method per operation, ~50 ms), for each region's client (`status --all` makes
    17) and each command's. Neither holds a client's state (credentials, endpoint and connections
    are the instance's); the class also depends on the handlers of `creating-client-class`, which
    boto3 registers alike on every session. So a session of ours (known by the shared loader)
    reuses what its service's first client built; any other session of the process builds its own,
    as botocore does."""
    from botocore.client import ClientCreator

    load_model = ClientCreator._load_service_model
    build_class = ClientCreator._create_client_class

    def ours(creator: Any) -> bool:
        return bool(_LOADER) and getattr(creator, "_loader", None) is _LOADER[0]

    def load_service_model(self: Any, service_name: str, api_version: Any = None) -> Any:
        if not ours(self):
            return load_model(self, service_name, api_version)
        return _once("model", service_name, api_version, lambda: load_model(self, service_name, api_version))

    def create_client_class(self: Any, service_name: str, service_model: Any) -> type:
        if not ours(self):
            return build_class(self, service_name, service_model)
        return _once("class", service_name, service_model.api_version,
                     lambda: build_class(self, service_name, service_model))

    ClientCreator._load_service_model = load_service_model
    ClientCreator._create_client_class = create_client_class
    _share_event_aliases()


def _share_event_aliases() -> None:
    """Every event botocore emits is renamed through its table of aliases first (a loop over ~40
    of them), and each copy of an emitter (one per client) starts that memo empty: a new client's
    first calls renamed each of their events again. The answer depends on the name and the table
    alone: emitters with botocore's own table share one memo."""
    from botocore.hooks import EventAliaser
    from botocore.utils import EVENT_ALIASES

    init = EventAliaser.__init__
    shared: dict[str, str] = {}

    def __init__(self: Any, event_emitter: Any, event_aliases: Any = None) -> None:
        init(self, event_emitter, event_aliases)
        if self._event_aliases == EVENT_ALIASES:
            self._alias_name_cache = shared

    EventAliaser.__init__ = __init__


class Aws:
    """A boto3 session for one region, with retrying clients created on first use."""

    clock: Clock = REAL_CLOCK  # the pauses between its retries of a call (a test drives its own)

    def __init__(self, region: str = "", profile: str = ""):
        import boto3
        from botocore import exceptions as bx

        try:
            self.session = boto3.session.Session(profile_name=profile or None, region_name=region or None,
                                                 botocore_session=_botocore_session())
        except bx.BotoCoreError as exc:
            raise translate(exc) from exc
        self.region = self.session.region_name or ""
        if not self.region:
            raise translate(bx.NoRegionError())
        known = self.session.get_available_regions("ec2")
        if known and self.region not in known:
            close = difflib.get_close_matches(self.region, known, n=1)
            raise ConfigError(
                f"unknown AWS region {self.region!r}",
                f"Did you mean {close[0]!r}?" if close else f"Known regions: {', '.join(sorted(known))}.",
            )
        if self.session.get_credentials() is None:
            raise translate(bx.NoCredentialsError())
        self._clients: dict[tuple[str, str, int], Any] = {}
        self._lock = threading.Lock()  # creating clients is not thread-safe; using them is
        self._recent: dict[tuple[Any, ...], tuple[float, Any]] = {}

    def client(self, service: str, region: str | None = None, retries: int = 5) -> Any:
        """A client for the service; fewer `retries` for a call with a fallback (the Price List)."""
        from botocore.config import Config

        key = (service, region or self.region, retries)
        with self._lock:
            if key not in self._clients:
                # "standard" retries cover throttling and 5xx with backoff; capacity errors are not
                # retried here (they are the caller's cue to try the next zone).
                # (botocore's retries["max_attempts"] counts the retries, not the first try.)
                # The user's own boto3 setting (AWS_MAX_ATTEMPTS, `max_attempts` in ~/.aws/config)
                # wins: it counts the first try too.
                mine = self.session._session.get_config_variable("max_attempts")
                tries = {"total_max_attempts": int(mine)} if mine else {"max_attempts": retries}
                config = Config(retries={"mode": "standard", **tries}, connect_timeout=10, read_timeout=60)
                client = self.session.client(service, region_name=key[1], config=config)
                client.meta.events.register("after-call", _not_an_api_answer)
                self._clients[key] = client
            return self._clients[key]

    def ec2(self, region: str | None = None) -> Any:
        return self.client("ec2", region)

    def recent(self, key: tuple[Any, ...], fetch: Callable[[], T], max_age_s: float = RECENT_S) -> T:
        """`fetch()`'s answer, or the one this session got for `key` less than `max_age_s` ago:
        `up` reads an instance type, its zones and their spot prices for the price it asks about,
        then again to launch (three more round trips to AWS, and the price launched at could differ
        from the one just agreed to). Answers only, not errors; not to be changed by the caller."""
        now = time.monotonic()
        with self._lock:
            kept = self._recent.get(key)
        if kept is not None and now - kept[0] < max_age_s:
            return kept[1]
        answer = fetch()
        with self._lock:
            self._recent[key] = (now, answer)
        return answer


__all__ = ["Aws", "CAPACITY_CODES", "QUOTA_CODES", "NoCapacityError", "call", "call_in", "error_code", "quota_hint", "translate",
           "wait_for"]

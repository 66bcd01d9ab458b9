"""S3 as this machine reads a data set for `train --data s3://...`: a bucket's region (HeadBucket)
and a prefix's objects (ListObjectsV2), over HTTP with requests signed by gpuctl_s3sign (SigV4,
the one implementation the links and the instances use), without boto3's client.

Why not boto3: its session and S3 client cost ~48 MB before the first object, and its parsed
pages (a dict per object, a datetime each) ~37 MB more at 100,000 objects (issue 38: the CLI's
peak at 100,000 objects was 121 MB, target 100). Here each page's XML is read as it arrives
(XMLPullParser, each <Contents> dropped once read), every object kept as one tuple.

What is still botocore's: the credentials (its chain: env, profile, SSO, process, container,
instance metadata; a botocore Session without any client, ~17 MB) and where S3 is
(AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile's endpoint_url, as botocore resolves them;
else AWS's own endpoint of the region). Proxies from the environment (HTTPS_PROXY, NO_PROXY) and
AWS_CA_BUNDLE are honoured as boto3 does. Throttling, 5xx and cut connections are tried again
with backoff (5 tries, as boto3's standard mode). A bucket's answers are untrusted: a page is
bounded in size, an error body too."""

from __future__ import annotations

import http.client
import ssl
import threading
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
from typing import Any, Callable, Iterator, NamedTuple, TypeVar

from gpuctl.errors import CloudError
from gpuctl.payloads import gpuctl_s3sign as sign
from gpuctl.retry import REAL_CLOCK, Backoff, Clock

T = TypeVar("T")
TRIES = 5
TIMEOUT_S = 60.0
# Keys a page asks for: S3's own default and most, said so a test can ask for small pages (a
# listing must follow continuation tokens whatever size S3 gives a page).
PAGE_KEYS = 1000
MAX_PAGE = 32 << 20  # one page of 1,000 keys of 1,024 bytes, URL-quoted: ~10 MB
MAX_ERROR = 64 << 10
RETRIED = frozenset({"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling",
                     "ThrottlingException", "RequestTimeTooSkewed"})
Obj = tuple[str, int, str]  # (key, size, ETag without quotes)


class Answer(NamedTuple):
    """An S3 answer that was not a success: its status, headers (lowercase names), error code
    (the XML body's, or the status for a HEAD) and message."""

    status: int
    headers: dict[str, str]
    code: str
    message: str


class Failed(Exception):
    def __init__(self, answer: Answer):
        super().__init__(f"{answer.code}: {answer.message}")
        self.answer = answer


class S3Http:
    """This machine's S3 reader for one profile; `region` where a bucket's own is not known yet."""

    clock: Clock = REAL_CLOCK

    def __init__(self, profile: str = "", region: str = ""):
        self.profile, self.region = profile, region or "us-east-1"
        self._lock = threading.Lock()
        self._session: Any = None
        self._creds: sign.Credentials | None = None
        self._idle: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}

    # --- what botocore resolves ----------------------------------------------------------------

    def _botocore(self) -> Any:
        with self._lock:
            if self._session is None:
                import botocore.session
                from botocore import exceptions as bx

                from gpuctl.provision.aws.session import translate

                try:
                    self._session = botocore.session.Session(profile=self.profile or None)
                    self._session.get_scoped_config()  # an unknown profile says so here
                except bx.BotoCoreError as exc:
                    raise translate(exc) from exc
            return self._session

    def credentials(self) -> sign.Credentials:
        """The user's credentials (botocore's chain), frozen once for this reader."""
        session = self._botocore()
        with self._lock:
            if self._creds is None:
                from botocore import exceptions as bx

                from gpuctl.provision.aws.session import translate

                try:
                    found = session.get_credentials()
                    frozen = found.get_frozen_credentials() if found is not None else None
                except bx.BotoCoreError as exc:
                    raise translate(exc) from exc
                if frozen is None or not frozen.access_key:
                    raise translate(bx.NoCredentialsError())
                self._creds = sign.Credentials(frozen.access_key, frozen.secret_key, frozen.token or None)
            return self._creds

    def configured_endpoint(self) -> str | None:
        """The endpoint the user set for S3 (env or profile), as botocore finds it; None: AWS's."""
        session = self._botocore()
        if session.get_config_variable("ignore_configured_endpoint_urls"):
            return None
        from botocore.configprovider import ConfiguredEndpointProvider

        found = ConfiguredEndpointProvider(full_config=session.full_config, scoped_config=session.get_scoped_config(),
                                           client_name="s3").provide()
        return str(found).rstrip("/") if found else None

    def endpoint(self, region: str) -> str:
        """scheme://host[:port] of S3 for a region: the configured one, else AWS's regional one."""
        suffix = ".amazonaws.com.cn" if region.startswith("cn-") else ".amazonaws.com"
        return self.configured_endpoint() or f"https://s3.{region}{suffix}"

    def _ssl(self) -> ssl.SSLContext:
        import os

        bundle = os.environ.get("AWS_CA_BUNDLE") or self._botocore().get_config_variable("ca_bundle")
        return ssl.create_default_context(cafile=bundle or None)

    # --- requests ------------------------------------------------------------------------------

    def head_bucket(self, bucket: str, region: str) -> tuple[int, dict[str, str]]:
        """HeadBucket's status and headers, whatever they are (x-amz-bucket-region comes with a
        200, a 301, a 400 and often a 403); CloudError when S3 cannot be reached."""
        try:
            return 200, self._send("HEAD", bucket, region, [], lambda res: {k.lower(): v for k, v in res.getheaders()})
        except Failed as failed:
            return failed.answer.status, failed.answer.headers

    def pages(self, bucket: str, prefix: str, region: str) -> Iterator[list[Obj]]:
        """The objects below the prefix, a page (up to PAGE_KEYS) at a time, keys whole (prefix
        included); Failed with S3's answer for an error."""
        token = ""
        while True:
            query = [("list-type", "2"), ("prefix", prefix), ("encoding-type", "url"), ("max-keys", str(PAGE_KEYS))]
            if token:
                query.append(("continuation-token", token))
            objects, token = self._send("GET", bucket, region, query, _page)
            yield objects
            if not token:
                return

    def _where(self, bucket: str, region: str) -> tuple[str, str, str, str]:
        """(scheme, host[:port] to connect to, Host as signed, the bucket's path): AWS's own
        endpoints virtual-hosted (bucket.s3.REGION.amazonaws.com, unless the name has a dot),
        any other endpoint with the bucket in the path, as boto3 addresses them."""
        endpoint = self.endpoint(region)
        u = urllib.parse.urlsplit(endpoint)
        virtual = (u.hostname or "").endswith((".amazonaws.com", ".amazonaws.com.cn")) and "." not in bucket
        host = f"{bucket}.{u.netloc}" if virtual else u.netloc
        return u.scheme, host, host, u.path.rstrip("/") + ("/" if virtual else "/" + bucket)

    def _send(self, method: str, bucket: str, region: str, query: list[tuple[str, str]],
              read: Callable[[http.client.HTTPResponse], T]) -> T:
        scheme, netloc, host, path = self._where(bucket, region)
        creds = self.credentials()
        target = urllib.parse.quote(path, safe="/-_.~") + ("?" + sign.canonical_query(query) if query else "")
        pauses = Backoff(0.2, 5.0, clock=self.clock)
        for attempt in range(1, TRIES + 1):
            conn = self._take(scheme, netloc)
            try:
                headers = sign.authorization(creds, region, method, host, path, query)
                conn.request(method, target if not getattr(conn, "_gpuctl_absolute", False)
                             else f"{scheme}://{netloc}{target}", headers=headers)
                res = conn.getresponse()
                if res.status == 200:
                    answer = read(res)
                    self._give(scheme, netloc, conn, res)
                    return answer
                failed = _failure(res, method)
                self._give(scheme, netloc, conn, res)
            except (OSError, http.client.HTTPException, ET.ParseError) as exc:
                conn.close()
                if attempt == TRIES:
                    raise CloudError(f"cannot read from S3 at {netloc}: {type(exc).__name__}: {exc}"[:300],
                                     "Check the network (and a proxy in HTTPS_PROXY), then try again.") from exc
                pauses.pause()
                continue
            if attempt < TRIES and (failed.status >= 500 or failed.code in RETRIED):
                pauses.pause()
                continue
            raise Failed(failed)
        raise AssertionError("unreachable")

    def _take(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        with self._lock:
            idle = self._idle.get((scheme, netloc))
            if idle:
                return idle.pop()
        host, _, port = netloc.rpartition(":") if netloc.rpartition(":")[2].isdigit() else (netloc, "", "")
        proxy = urllib.request.getproxies().get(scheme)
        if proxy and urllib.request.proxy_bypass(host):
            proxy = None
        kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        args: dict[str, Any] = {"timeout": TIMEOUT_S}
        if scheme == "https":
            args["context"] = self._ssl()
        if not proxy:
            return kind(host, int(port) if port else None, **args)
        p = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
        if scheme == "https":  # a CONNECT tunnel through the proxy
            conn: http.client.HTTPConnection = kind(p.hostname or "", p.port, **args)
            conn.set_tunnel(host, int(port) if port else None)
            return conn
        conn = http.client.HTTPConnection(p.hostname or "", p.port, timeout=TIMEOUT_S)
        conn._gpuctl_absolute = True  # type: ignore[attr-defined]  # a plain proxy takes the whole URL
        return conn

    def _give(self, scheme: str, netloc: str, conn: http.client.HTTPConnection, res: http.client.HTTPResponse) -> None:
        """The connection back for the next request, if its answer was read to the end."""
        if not res.isclosed() or res.will_close:
            conn.close()
            return
        with self._lock:
            self._idle.setdefault((scheme, netloc), []).append(conn)


def _failure(res: http.client.HTTPResponse, method: str) -> Answer:
    headers = {k.lower(): v for k, v in res.getheaders()}
    body = res.read(MAX_ERROR) if method != "HEAD" else b""
    code = message = ""
    if body:
        try:
            root = ET.fromstring(body)
            code = root.findtext("Code") or ""
            message = root.findtext("Message") or ""
        except ET.ParseError:
            message = body[:200].decode("utf-8", "replace")
    if not res.isclosed():
        res.close()
    return Answer(res.status, headers, code or str(res.status), message)


def _page(res: http.client.HTTPResponse) -> tuple[list[Obj], str]:
    """One ListObjectsV2 page read as it arrives: its objects (keys URL-decoded: encoding-type=url,
    so that any key, control characters too, can cross XML) and the next page's token ("" for
    none). Each <Contents> is emptied once read (what is left of a page: 1,000 empty elements)."""
    parser = ET.XMLPullParser(events=("end",))
    objects: list[Obj] = []
    got, truncated, token, ns, root = 0, False, "", "", ""
    unquote = urllib.parse.unquote_plus
    while True:
        chunk = res.read(1 << 16)
        if not chunk:
            break
        got += len(chunk)
        if got > MAX_PAGE:
            raise ET.ParseError(f"a listing page over {MAX_PAGE >> 20} MB")
        parser.feed(chunk)
        for happened in parser.read_events():
            el = happened[-1]
            if not isinstance(el, ET.Element):  # "end" events carry elements
                continue
            tag = el.tag
            if not ns:
                ns = tag[:tag.index("}") + 1] if tag.startswith("{") else "-"
            name = tag[len(ns):] if ns != "-" else tag
            if name == "Contents":
                key = size = etag = ""
                for field in el:
                    what = field.tag[len(ns):] if ns != "-" else field.tag
                    if what == "Key":
                        key = field.text or ""
                    elif what == "Size":
                        size = (field.text or "").strip()
                    elif what == "ETag":
                        etag = field.text or ""
                if not size.isdigit() or len(size) > 18:
                    raise ET.ParseError(f"an object's size is not a number: {size[:40]!r}")
                objects.append((unquote(key), int(size), etag.strip('"')))
                el.clear()
            elif name == "IsTruncated":
                truncated = (el.text or "").strip().lower() == "true"
            elif name == "NextContinuationToken":
                token = el.text or ""
            elif name == "ListBucketResult":
                root = name
    parser.close()
    if root != "ListBucketResult":
        raise ET.ParseError("the answer is not a ListObjectsV2 listing")
    return objects, token if truncated else ""

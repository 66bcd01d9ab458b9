"""Presigned S3 GET links (AWS Signature Version 4, query string authentication), with stdlib only
(Python 3.8+): made on this machine with the user's credentials for a host that has none
(provision/aws/presign.py), and on an aws instance with its own role's credentials, read from
its metadata service (IMDSv2), for the objects of a data set (gpuctl_fetch.py).

A link grants one GET of one object until it expires, and carries no secret: the signature is
an HMAC; a session token, where the credentials have one, is part of it as S3 requires. The
signing key is the same for every link of a day, region and service: it is derived once and each
link costs one HMAC (boto3's generate_presigned_url builds a whole request per link, ~0.3 ms).
tests/unit/test_s3_data.py checks the links are byte for byte botocore's."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import urllib.parse
import urllib.request
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

MAX_EXPIRES_S = 7 * 24 * 3600  # SigV4's limit for a presigned link
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # the payload hash of a request without a body


class Credentials(NamedTuple):
    access_key: str
    secret_key: str
    token: Optional[str]
    expires_at: Optional[float] = None  # epoch seconds (a role's); None: not known to expire


def _quote(text: str, safe: str = "-_.~") -> str:
    return urllib.parse.quote(text, safe=safe)


def links(creds: Credentials, region: str, endpoint: str, virtual_hosted: bool, bucket: str, keys: List[str],
          expires_s: int, now: Optional[float] = None) -> List[str]:
    """One presigned GET link per key, valid `expires_s` from `now`. `endpoint`: scheme://host[:port]
    of S3 as the fetching host reaches it; `virtual_hosted`: bucket.host/key (AWS's own
    endpoints), else host/bucket/key."""
    template, sign = signer(creds, region, endpoint, virtual_hosted, bucket, "", expires_s, now)
    return [template_link(template, key, sign(key)) for key in keys]


def signer(creds: Credentials, region: str, endpoint: str, virtual_hosted: bool, bucket: str, prefix: str,
           expires_s: int, now: Optional[float] = None) -> Tuple[Dict[str, str], Callable[[str], str]]:
    """(template, sign): what every link to an object below `prefix` shares ({"base", "query"}:
    a plan carries it once), and sign(rel), the one part of the link to prefix + rel that is its
    own (64 hex): template_link(template, rel, sign(rel)) is the link. 100,000 links with a
    session token are ~150 MB; their signatures, 6.4 MB."""
    expires_s = max(1, min(int(expires_s), MAX_EXPIRES_S))
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    day = stamp[:8]
    scope = "%s/%s/s3/aws4_request" % (day, region)
    key = signing_key(creds.secret_key, day, region)
    u = urllib.parse.urlsplit(endpoint)
    host = "%s.%s" % (bucket, u.netloc) if virtual_hosted else u.netloc
    base_path = u.path.rstrip("/") + ("" if virtual_hosted else "/" + bucket)
    params = [("X-Amz-Algorithm", "AWS4-HMAC-SHA256"), ("X-Amz-Credential", "%s/%s" % (creds.access_key, scope)),
              ("X-Amz-Date", stamp), ("X-Amz-Expires", str(expires_s)), ("X-Amz-SignedHeaders", "host")]
    if creds.token:
        params.append(("X-Amz-Security-Token", creds.token))
    query = "&".join("%s=%s" % (_quote(k), _quote(v)) for k, v in sorted(params))  # the canonical order
    shown = "&".join("%s=%s" % (_quote(k), _quote(v)) for k, v in params)  # botocore's order in the link
    head = "AWS4-HMAC-SHA256\n%s\n%s\n" % (stamp, scope)
    # Quoting is character by character: quote(prefix + rel) == quote(prefix) + quote(rel).
    template = {"base": "%s://%s%s/%s" % (u.scheme, host, base_path, _quote(prefix, safe="/-_.~")), "query": shown}

    def sign(rel: str) -> str:
        path = "%s/%s" % (base_path, _quote(prefix + rel, safe="/-_.~"))
        request = "GET\n%s\n%s\nhost:%s\n\nhost\nUNSIGNED-PAYLOAD" % (path, query, host)
        return hmac.new(key, (head + hashlib.sha256(request.encode()).hexdigest()).encode(),
                        hashlib.sha256).hexdigest()

    return template, sign


def signing_key(secret_key: str, day: str, region: str) -> bytes:
    """SigV4's key for S3 requests of one day (YYYYMMDD) and region."""
    key = hmac.new(("AWS4" + secret_key).encode(), day.encode(), hashlib.sha256).digest()
    for part in (region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def authorization(creds: Credentials, region: str, method: str, host: str, path: str,
                  query: List[Tuple[str, str]], now: Optional[float] = None) -> Dict[str, str]:
    """The headers that sign one S3 request without a body (HEAD, GET: a bucket's region, a
    listing) in the Authorization header, as botocore's S3SigV4Auth does: Host (as sent, with a
    port that is not the scheme's), x-amz-date, x-amz-content-sha256, x-amz-security-token where
    the credentials have a session token, Authorization. `path` unquoted (/bucket, /bucket/key);
    `query` the request's own parameters, sent as canonical_query(query)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    scope = "%s/%s/s3/aws4_request" % (stamp[:8], region)
    headers = {"host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": stamp}
    if creds.token:
        headers["x-amz-security-token"] = creds.token
    names = sorted(headers)
    request = "\n".join([method, _quote(path, safe="/-_.~"), canonical_query(query),
                         "".join("%s:%s\n" % (n, headers[n].strip()) for n in names), ";".join(names), EMPTY_SHA256])
    text = "AWS4-HMAC-SHA256\n%s\n%s\n%s" % (stamp, scope, hashlib.sha256(request.encode()).hexdigest())
    signature = hmac.new(signing_key(creds.secret_key, stamp[:8], region), text.encode(), hashlib.sha256).hexdigest()
    headers["Authorization"] = "AWS4-HMAC-SHA256 Credential=%s/%s, SignedHeaders=%s, Signature=%s" % (
        creds.access_key, scope, ";".join(names), signature)
    headers["Host"] = headers.pop("host")
    return headers


def canonical_query(query: List[Tuple[str, str]]) -> str:
    """A query string as SigV4 signs it (each name and value quoted, sorted): sent as it is."""
    return "&".join("%s=%s" % kv for kv in sorted((_quote(k), _quote(v)) for k, v in query))


def template_link(template: Dict[str, str], rel: str, signature: str) -> str:
    """The link to the object `rel` below the template's prefix, with its signature."""
    return "%s%s?%s&X-Amz-Signature=%s" % (template["base"], _quote(rel, safe="/-_.~"), template["query"], signature)


def imds_credentials(endpoint: str, timeout: float = 5.0) -> Credentials:
    """The instance profile's credentials from the metadata service (IMDSv2: a token first), as
    boto3 reads them on EC2."""
    base = endpoint.rstrip("/")
    put = urllib.request.Request(base + "/latest/api/token", method="PUT",
                                 headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"})
    with urllib.request.urlopen(put, timeout=timeout) as res:
        token = res.read().decode()
    headers = {"X-aws-ec2-metadata-token": token}

    def get(path: str) -> str:
        req = urllib.request.Request(base + "/latest/meta-data/iam/security-credentials/" + path, headers=headers)
        with urllib.request.urlopen(req, timeout=timeout) as res:
            return str(res.read(1 << 16).decode())

    role = get("").strip().splitlines()[0]
    data: Dict[str, str] = json.loads(get(role))
    expires = None
    if data.get("Expiration"):
        import calendar

        expires = float(calendar.timegm(time.strptime(data["Expiration"], "%Y-%m-%dT%H:%M:%SZ")))
    return Credentials(data["AccessKeyId"], data["SecretAccessKey"], data.get("Token"), expires)

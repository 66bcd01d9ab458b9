"""Runs on the host: fetches a data set from S3 into gpuctl's data store there, many objects at
once (threads), and keeps it: a cache keyed by each object's key, size and ETag. Stdlib only;
Python 3.8+.

    python3 gpuctl_fetch.py need  PLAN     one JSON line: which objects are not here yet, the
                                           bytes they need and the bytes free on that disk
    python3 gpuctl_fetch.py fetch PLAN     fetch what is not here; STATUS and RESULT files (below)

PLAN is a JSON file gpuctl writes (mode 0600: its links are presigned, bearer tokens until they
expire): {"version": 1, "dir": DATA_DIR, "source": "s3://BUCKET/PREFIX/", "threads": N,
"link": {"base", "query"}, "objects": [[rel, size, etag, signature or null], ...]}: a link is
the template completed by the object's signature (gpuctl_s3sign.template_link); without "link",
each object's whole link. `need` reads none; `fetch` needs one for each object `need` named. No key or secret ever reaches this side. On an aws instance with its
cluster's role the plan has no links but "sign": {imds, bucket, prefix, region, endpoint,
virtual}: the links are signed here with the role's own credentials (gpuctl_s3sign.py), which
may read exactly that prefix.

Beside DATA_DIR (so the job, which sees DATA_DIR, never does) is META, `.NAME.gpuctl-fetch/`:
manifest.json (rel -> [size, etag] of every file fetched whole), journal (one line per file
fetched since the manifest was written: a fetch cut by a kill loses nothing it finished),
parts/ (downloads under way, named by the hash of their path and ETag: a cut one goes on from
its last byte with a Range request, never with another version's bytes), lock (one fetch of a
data set at a time: a second waits, then finds it all here), status.PID.json (progress,
rewritten twice a second) and result.PID.json.

A file is renamed into DATA_DIR only once verified: its size, and its MD5 where the ETag is one
(no '-': not a multipart upload; not encrypted with a KMS or customer key, whose ETags are not). Every GET carries If-Match with the listed ETag, so an object
changed since the listing answers 412 and is named in the result (`changed`) instead of mixing
two versions; 500/503 (SlowDown) are waited out with backoff. A file in DATA_DIR whose object
is no longer listed is removed (the runs' own copies are hard links: theirs stay).

Object keys are untrusted: a path that is absolute, has '..', '.' or empty parts, a control
character, a backslash, a part over 255 bytes or is over 4000 bytes is refused (gpuctl_datacache.py's
`check_rel`, which gpuctl also asks before it starts anything), and nothing is written outside DATA_DIR,
through a link either.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import hashlib
import http.client
import json
import os
import random
import ssl
import sys
import threading
import time
import urllib.parse
from typing import Any, Dict, List, Optional, Tuple

import gpuctl_s3sign  # beside this file on the instance
from gpuctl_datacache import (  # beside this file on the instance
    Obj, free_bytes, load_plan, meta_dir, need, part_name, plain_md5, remove_stale, save_known, sort_out, write_json,
)

CHUNK = 1 << 20
RETRIES = 8  # tries of one object on a 5xx or a cut connection
EXIT_SHORT = 3  # `fetch`: the disk cannot hold what is missing (nothing fetched)



class Changed(Exception):
    """The object is not what the listing said (412 on If-Match, another ETag or size)."""


class Failed(Exception):
    pass


# --- the fetch -------------------------------------------------------------------------------------


class Progress(object):
    def __init__(self, files_total: int, bytes_total: int) -> None:
        self.lock = threading.Lock()
        self.files_total, self.bytes_total = files_total, bytes_total
        self.files_done = self.bytes_done = self.fetched_bytes = self.retries = 0
        self.started = time.time()

    def add(self, n: int) -> None:
        with self.lock:
            self.bytes_done += n
            self.fetched_bytes += n

    def snapshot(self) -> Dict[str, Any]:
        with self.lock:
            return {"files_total": self.files_total, "files_done": self.files_done, "bytes_total": self.bytes_total,
                    "bytes_done": self.bytes_done, "fetched_bytes": self.fetched_bytes, "retries": self.retries,
                    "elapsed": round(time.time() - self.started, 3)}


class Getter(object):
    """One thread's connections, one per server, kept open between objects."""

    def __init__(self, timeout: float) -> None:
        self.conns = {}  # type: Dict[Tuple[str, str], http.client.HTTPConnection]
        self.timeout = timeout

    def get(self, url: str, headers: Dict[str, str]) -> http.client.HTTPResponse:
        u = urllib.parse.urlsplit(url)
        key = (u.scheme, u.netloc)
        conn = self.conns.get(key)
        if conn is None:
            if u.scheme == "https":
                conn = http.client.HTTPSConnection(u.netloc, timeout=self.timeout, context=ssl.create_default_context())
            else:
                conn = http.client.HTTPConnection(u.netloc, timeout=self.timeout)
            self.conns[key] = conn
        target = u.path + ("?" + u.query if u.query else "")
        try:
            conn.request("GET", target, headers=headers)
            return conn.getresponse()
        except Exception:
            self.drop(key)
            raise

    def drop(self, key: Tuple[str, str]) -> None:
        conn = self.conns.pop(key, None)
        if conn is not None:
            conn.close()

    def drop_url(self, url: str) -> None:
        u = urllib.parse.urlsplit(url)
        self.drop((u.scheme, u.netloc))


def encrypted_by_key(res: http.client.HTTPResponse) -> bool:
    """An object encrypted with a KMS key or the customer's own (SSE-KMS, DSSE-KMS, SSE-C): S3 gives
    it an ETag that is not the MD5 of its bytes, even from a single-part upload."""
    return (res.getheader("x-amz-server-side-encryption") or "").startswith("aws:kms") or \
        bool(res.getheader("x-amz-server-side-encryption-customer-algorithm"))


def backoff(attempt: int, base: float) -> float:
    return float(min(20.0, base * (2 ** attempt)) * random.uniform(0.5, 1.0))


class Signer(object):
    """An aws instance's own links: signed here with its role's credentials (IMDSv2), which are
    read again when they near their end. The plan's "sign": {imds, bucket, prefix, region,
    endpoint, virtual}."""

    def __init__(self, how: Dict[str, Any]) -> None:
        self.how = how
        self.lock = threading.Lock()
        self.creds = None  # type: Optional[gpuctl_s3sign.Credentials]

    def link(self, rel: str) -> str:
        with self.lock:
            c = self.creds
            if c is None or (c.expires_at is not None and c.expires_at - time.time() < 600):
                c = self.creds = gpuctl_s3sign.imds_credentials(self.how["imds"])
        h = self.how
        return gpuctl_s3sign.links(c, h["region"], h["endpoint"], bool(h.get("virtual")), h["bucket"],
                                   [h["prefix"] + rel], 3600)[0]

    def renew(self) -> None:
        """A 403: a policy just put may take seconds to reach the role (IAM is eventually
        consistent), and credentials rotate; read them again before the next try."""
        with self.lock:
            self.creds = None


def fetch_one(getter: Getter, root: str, parts: str, obj: Obj, progress: Progress, base: float,
              signer: Optional[Signer] = None, template: Optional[Dict[str, str]] = None) -> None:
    """Fetch one object into its part file, verify it, rename it into DATA_DIR. `template`: the
    plan's "link", which the object's signature completes into its link."""
    rel, size, etag, url = obj
    if url and template is not None:
        url = gpuctl_s3sign.template_link(template, rel, url)
    if not url and signer is None:
        raise Failed("no link for it (the plan is older than the cache): train again")
    part = os.path.join(parts, part_name(rel, etag))
    check = plain_md5(etag)
    last = "none"
    for attempt in range(RETRIES):
        have = os.path.getsize(part) if os.path.exists(part) else 0
        if have > size:
            os.unlink(part)
            have = 0
        md5 = hashlib.md5() if check else None
        if have and md5 is not None:
            with open(part, "rb") as fh:
                for block in iter(lambda: fh.read(CHUNK), b""):
                    md5.update(block)
        if have and have == size:
            break
        if signer is not None:
            url = signer.link(rel)
        assert url is not None
        headers = {"If-Match": '"%s"' % etag} if etag else {}
        if have:
            headers["Range"] = "bytes=%d-" % have
        try:
            res = getter.get(url, headers)
        except (OSError, http.client.HTTPException) as exc:
            progress.retries += 1
            time.sleep(backoff(attempt, base))
            last = "%s: %s" % (type(exc).__name__, exc)
            continue
        status = res.status
        if status in (500, 502, 503, 504):
            res.read()
            progress.retries += 1
            time.sleep(backoff(attempt, base))
            last = "HTTP %d%s" % (status, " (SlowDown)" if status == 503 else "")
            continue
        if status == 412 or status == 404:
            res.read()
            raise Changed("412: its ETag is no longer %s" % etag if status == 412 else "404: it is gone")
        if status == 416:  # the part holds more than the object now has
            res.read()
            os.unlink(part)
            continue
        if status == 403 and signer is not None and attempt < RETRIES - 1:
            res.read()
            signer.renew()
            progress.retries += 1
            time.sleep(backoff(attempt + 2, base))
            last = "HTTP 403 (the role's policy not in force yet?)"
            continue
        if status not in (200, 206):
            body = res.read(2048)
            getter.drop_url(url)
            why = "the link expired or access was denied" if status == 403 else body[:200].decode("utf-8", "replace")
            raise Failed("HTTP %d: %s" % (status, why))
        got_etag = (res.getheader("ETag") or "").strip('"')
        if etag and got_etag and got_etag != etag:
            res.read()
            raise Changed("its ETag is %s now, not %s" % (got_etag, etag))
        if check and encrypted_by_key(res):
            check, md5 = False, None  # its ETag is no MD5 of its bytes (S3 says so for SSE-KMS and SSE-C)
        mode = "ab" if status == 206 else "wb"
        if status == 200:
            have = 0
            md5 = hashlib.md5() if check else None
        try:
            with open(part, mode) as fh:
                while True:
                    block = res.read1(CHUNK)  # what has arrived: a cut body leaves all it got in the part
                    if not block:
                        break
                    fh.write(block)
                    if md5 is not None:
                        md5.update(block)
                    progress.add(len(block))
        except (OSError, http.client.HTTPException) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise Failed("the disk is full") from None
            getter.drop_url(url)
            progress.retries += 1
            last = "%s: %s" % (type(exc).__name__, exc)
            continue  # the next try asks for the rest
        if res.will_close:
            getter.drop_url(url)
        got = os.path.getsize(part)
        if got != size:
            if got > size:
                os.unlink(part)
                raise Changed("%d bytes arrived, the listing said %d" % (got, size))
            last = "cut at %d of %d bytes" % (got, size)
            continue
        if md5 is not None and md5.hexdigest() != etag.lower():
            os.unlink(part)
            raise Changed("its MD5 is %s, its ETag %s" % (md5.hexdigest(), etag))
        break
    else:
        raise Failed("gave up after %d tries (last: %s)" % (RETRIES, last))
    dest = os.path.join(root, *rel.split("/"))
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    real_root = os.path.realpath(root)
    real = os.path.realpath(parent)
    if real != real_root and not real.startswith(real_root + os.sep):
        raise Failed("its directory leads outside the data directory")
    if os.path.lexists(dest) and (os.path.islink(dest) or os.path.isdir(dest)):
        raise Failed("a link or directory of that name is there")
    os.replace(part, dest)


def fetch(plan: Dict[str, Any], status_path: Optional[str] = None) -> Dict[str, Any]:
    root = plan["dir"]
    meta = meta_dir(root)
    parts = os.path.join(meta, "parts")
    for d in (root, parts):
        os.makedirs(d, exist_ok=True)
    started = time.time()
    with open(os.path.join(meta, "lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another fetch of this data set: it ends first, then we find its files
        todo, cached, refused, known = sort_out(plan)
        source = plan.get("source", "")
        wanted = set(o[0] for o in plan["objects"]) - set(r[0] for r in refused)
        removed = remove_stale(root, wanted)
        present = set(os.listdir(parts))  # downloads a cut fetch left (usually none)
        if present:
            present -= set(name for name in (part_name(o[0], o[2]) for _, o in todo) if name in present)
        for name in present:  # a part no object wants any more
            os.unlink(os.path.join(parts, name))
        result = {"ok": False, "cached": len(cached), "cached_bytes": sum(o[1] for o in cached), "fetched": 0,
                  "fetched_bytes": 0, "removed": removed, "refused": refused, "failed": [], "changed": [],
                  "threads": 0}  # type: Dict[str, Any]
        need_bytes = sum(o[1] for _, o in todo)
        free, reserve = free_bytes(root)
        if need_bytes > free - reserve:
            result.update(error="short", need=need_bytes, free=free)
            return result
        progress = Progress(len(todo) + len(cached), need_bytes + result["cached_bytes"])
        progress.files_done, progress.bytes_done = len(cached), result["cached_bytes"]
        files = dict((o[0], [o[1], o[2]]) for o in cached)
        journal = open(os.path.join(meta, "journal"), "a")
        # The big ones first: none is left to fetch alone at the end.
        queue = collections.deque(sorted((o for _, o in todo), key=lambda o: -o[1]))
        qlock = threading.Lock()
        base = float(plan.get("backoff_s", 0.5))
        timeout = float(plan.get("timeout_s", 60))
        shared_signer = Signer(plan["sign"]) if isinstance(plan.get("sign"), dict) else None

        def worker() -> None:
            getter = Getter(timeout)
            signer = shared_signer
            while True:
                with qlock:
                    if not queue:
                        return
                    obj = queue.popleft()
                try:
                    fetch_one(getter, root, parts, obj, progress, base, signer, plan.get("link"))
                except Changed as exc:
                    with qlock:
                        result["changed"].append([obj[0], str(exc)])
                    continue
                except (Failed, OSError) as exc:
                    with qlock:
                        result["failed"].append([obj[0], str(exc)])
                    continue
                with qlock:
                    journal.write(json.dumps([obj[0], obj[1], obj[2]]) + "\n")
                    journal.flush()
                    files[obj[0]] = [obj[1], obj[2]]
                    result["fetched"] += 1
                    result["fetched_bytes"] += obj[1]
                with progress.lock:
                    progress.files_done += 1

        stop = threading.Event()

        def report() -> None:
            while not stop.wait(0.5):
                if status_path:
                    write_json(status_path, progress.snapshot())

        n = max(1, min(int(plan.get("threads", 16)), len(queue) or 1))
        result["threads"] = n
        reporter = threading.Thread(target=report, daemon=True)
        reporter.start()
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        journal.close()
        save_known(meta, source, files)
        if status_path:
            write_json(status_path, progress.snapshot())
        result["retries"] = progress.retries
        result["seconds"] = round(time.time() - started, 3)
        result["ok"] = not (result["failed"] or result["changed"] or refused)
        return result


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] not in ("need", "fetch"):
        sys.stderr.write("usage: gpuctl_fetch.py need|fetch PLAN\n")
        return 2
    op, path = args
    meta = None
    try:
        plan = load_plan(path)
        if op == "need":
            print(json.dumps(need(plan)))
            return 0
        meta = meta_dir(plan["dir"])
        os.makedirs(meta, exist_ok=True)
        pid = os.getpid()
        result = fetch(plan, os.path.join(meta, "status.%d.json" % pid))
    except Exception as exc:  # noqa: BLE001 - the result says why, whatever it was
        result = {"ok": False, "error": "%s: %s" % (type(exc).__name__, exc)}
        if meta is None or op == "need":
            print(json.dumps(result))
            return 1
    write_json(os.path.join(meta, "result.%d.json" % os.getpid()), result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("failed", "changed", "refused")}))
    return 0 if result.get("ok") else (EXIT_SHORT if result.get("error") == "short" else 1)


if __name__ == "__main__":
    sys.exit(main())

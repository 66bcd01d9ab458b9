"""A data set in S3 (`train --data s3://BUCKET/PREFIX`, or `[train] data`): checked from this
machine before anything starts, then fetched by each node itself into its data store.

    check     this machine lists the prefix with the user's credentials: the bucket exists, may be
              read, holds objects (how many, how large), its region and what crossing to the
              cluster costs; every key checked as a path (payloads/gpuctl_datacache.check_rel)
    prepare   on each node, before anything is set up or pushed: what its cache lacks, and
              whether its disk holds that (gpuctl_fetch.py need)
    fetch     presigned links for what is missing (made here, never a key there), and the node
              fetches them itself (gpuctl_fetch.py fetch, detached: a closed laptop does not cut it,
              and a cut fetch goes on at the next train), its progress relayed

The data lands in the same store as a pushed `--data DIR`, data/s3-BUCKET-<8 hex of the URL>, and
is linked into the run's own dir (push.submit), so the script sees no difference. An object that
changed while it was fetched is fetched again after a fresh listing, once; then the run is
refused, naming it."""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, replace
from typing import Any, Callable, Collection, Iterator

from gpuctl.errors import DataError, RemoteError
from gpuctl.model import billing, untrusted
from gpuctl.model.data import FetchStats, S3Listing, S3Source, size_text
from gpuctl.model.records import ClusterRecord
from gpuctl.ops import guards
from gpuctl.ops.session import Progress, Session
from gpuctl.payloads import gpuctl_datacache as cache
from gpuctl.provision import DataSets, data_sets
from gpuctl.remote import jobs
from gpuctl.remote.host import Host
from gpuctl.retry import Backoff

PAYLOAD = "gpuctl_fetch.py"
THREADS = 16  # objects fetched at once on each node
SHOWN = 5  # refused or failed keys named in an error
MAX_ANSWER = 16 << 20  # `need`'s answer: the index of every missing object (100,000 objects: ~700 KB)
FOLLOW_S = 24 * 3600.0  # a fetch followed this long is given up on (it goes on there)
Signer = tuple[dict[str, str], Callable[[str], str]]  # DataSets.signer's
PLAN_CHUNK = 2000  # objects of the plan made into text at once
VOLUME_STORE = ".gpuctl-data"  # on a cluster's volume: the chief's data store (store_on)


@dataclass
class Fetch:
    """One train's data set: its reader (the user's credentials, here) and its listing."""

    reader: DataSets
    listing: S3Listing
    link_s: int
    where: str | None  # the cluster's region (None: a host outside AWS)
    origin: str = ""  # where the URL came from, when not the command line (a project's gpuctl.toml)
    access: dict[str, Any] | None = None  # the instances sign their own GETs (Provider.data_access)


def granted(s: Session, record: ClusterRecord, fetch: Fetch, progress: Progress) -> Fetch:
    """The fetch as the cluster's machines will read: with their own role where the provider has
    one for them (aws: now allowed exactly this prefix), else with links made here."""
    return replace(fetch, access=s.provider(record.spec).data_access(fetch.listing, progress))


def check(s: Session, source: S3Source, where: str | None, progress: Progress, origin: str = "") -> Fetch:
    """The listing, checked, with the line that says what it is and costs; DataError before
    anything starts: no such bucket, access denied, empty, an unsafe key."""
    loaded = s.settings()
    reader = data_sets(loaded.settings.aws.profile, where or loaded.settings.aws.region)
    fetch = Fetch(reader, reader.listing(source), int(loaded.settings.train.data_link_hours * 3600), where, origin)
    refuse_unsafe(fetch.listing)
    progress(describe(fetch))
    return fetch


def refuse_unsafe(listing: S3Listing) -> None:
    rels = [o[0] for o in listing.objects]
    clash = cache.conflicts(rels)
    bad = [(rel, why) for rel in rels if (why := cache.check_rel(rel) or clash.get(rel))]
    if bad:
        named = "; ".join(f"{untrusted.clean(repr(rel), 120)} ({why})" for rel, why in bad[:SHOWN])
        more = f" and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
        raise DataError(f"{listing.source.url} holds {len(bad)} key(s) gpuctl will not write as files: {named}{more}",
                        "Rename or delete those objects, or point --data at a prefix without them; nothing was "
                        "started (docs/data.md says which keys are refused).")


def describe(fetch: Fetch) -> str:
    """"data: s3://b/p/: 1,234 objects, 1.2 GB, bucket in eu-west-1 (...what crossing costs)"."""
    listing = fetch.listing
    gb = listing.total_bytes / 1e9
    per_gb, why = billing.s3_transfer(listing.region, fetch.where)
    cost = (f"{why}: ${per_gb:.2f}/GB, ~${per_gb * gb:.2f} for a node that fetches all of it"
            if per_gb else why)
    origin = f" (from {fetch.origin})" if fetch.origin else ""
    return (f"data: {listing.source.url}{origin}: {len(listing.objects):,} objects, {size_text(listing.total_bytes)}, "
            f"bucket in {listing.region}; {cost}")


# --- on a node ------------------------------------------------------------------------------------

def store_on(s: Session, record: ClusterRecord, rank: int, host: Host) -> str | None:
    """Where this node keeps its S3 data sets when not in its work dir's data/: on the cluster's
    volume for the chief of `up --volume` (VOLUME/.gpuctl-data, mounted first if need be), so the
    next cluster that mounts the volume finds them warm; None: the work dir's data/."""
    if rank != 0 or record.spec.volume is None:
        return None
    return posixpath.join(s.provider(record.spec).mount_volume(host)[0], VOLUME_STORE)


def run_copies(store: str | None) -> str | None:
    """Where the runs' own copies of a data set kept in `store` go, when not in their run dirs:
    beside it on the volume (hard links cannot cross from a volume to the instance's disk)."""
    return posixpath.join(store, "runs") if store is not None else None


def meta_dir(host: Host, source: S3Source, store: str | None = None) -> str:
    return cache.meta_dir(data_dir(host, source, store))


def data_dir(host: Host, source: S3Source, store: str | None = None) -> str:
    return posixpath.join(store or posixpath.join(host.root, "data"), source.place)


def _plan(host: Host, fetch: Fetch, missing: Collection[int] = (), sign: bool = False, store: str | None = None,
          signer: Signer | None = None) -> str:
    """The plan written on the host (0600: links are bearer tokens until they expire); its path.
    `signer`: (what the links share, a function signing one path) for the `missing` objects'
    links (gpuctl_s3sign.template_link); `sign`: the host signs its own GETs (fetch.access)
    instead. Signed and written a part at a time: neither the plan of 100,000 objects nor their
    signatures are ever all in memory here."""
    template, signed = signer if signer is not None else (None, None)
    source = fetch.listing.source
    path = posixpath.join(meta_dir(host, source, store), "plan.json")
    head: dict[str, Any] = {"version": cache.PLAN_VERSION, "dir": data_dir(host, source, store), "source": source.url,
                            "threads": THREADS}
    if template is not None:
        head["link"] = template
    if sign and fetch.access is not None:
        head["sign"] = fetch.access
    objects = fetch.listing.objects
    chunks = (",".join(json.dumps([rel, size, etag, signed(rel) if signed is not None and i in missing else None],
                                  separators=(",", ":"))
                       for i, (rel, size, etag) in enumerate(objects[at:at + PLAN_CHUNK], at)).encode()
              for at in range(0, len(objects), PLAN_CHUNK))
    host.write_chunks(path, _joined(json.dumps(head)[:-1].encode() + b', "objects": [', chunks, b"]}"), mode=0o600)
    return path


def _joined(first: bytes, middle: Iterator[bytes], last: bytes) -> Iterator[bytes]:
    yield first
    for i, chunk in enumerate(middle):
        yield (b"," if i else b"") + chunk
    yield last


def _payload(s: Session, host: Host, *args: str) -> list[str]:
    facts = s.facts(host)
    return [facts.python_of(host), posixpath.join(guards.push_payload(host, facts), PAYLOAD), *args]


def prepare(s: Session, host: Host, fetch: Fetch, store: str | None = None) -> list[int]:
    """What the node's cache lacks (indices into the listing); DataError when its disk cannot
    hold that. Nothing is set up, pushed or started before this. `store`: store_on's."""
    plan = _plan(host, fetch, store=store)
    res = host.run(_payload(s, host, "need", plan), check=False, output_limit=MAX_ANSWER)
    try:
        answer = untrusted.loads(res.stdout.strip().splitlines()[-1] if res.stdout.strip() else None, MAX_ANSWER)
        missing = [int(i) for i in answer["missing"]]
        need, free, reserve = int(answer["need"]), int(answer["free"]), int(answer["reserve"])
    except (untrusted.Untrusted, KeyError, TypeError, ValueError):
        raise RemoteError(f"the data check on {host.label} answered no plan ({untrusted.clean(res.stderr, 300)})",
                          "Rerun with --debug; the host needs python3 (3.8 or newer).") from None
    if not all(0 <= i < len(fetch.listing.objects) for i in missing):
        raise RemoteError(f"the data check on {host.label} named objects that are not in the listing")
    if need > free - reserve:
        raise DataError(f"{fetch.listing.source.url} needs {size_text(need)} more on {host.label}, which has "
                        f"{size_text(max(0, free - reserve))} free for it (after {size_text(reserve)} kept free)",
                        "Free space there (`gpuctl runs rm` old runs), or `gpuctl up` a cluster with a bigger disk "
                        "(--disk-gb); nothing was started.")
    return missing


def fetch_on(s: Session, host: Host, fetch: Fetch, missing: list[int], progress: Progress,
             store: str | None = None) -> FetchStats:
    """Fetch what the node lacks, following its progress; once more after a fresh listing for
    objects that changed meanwhile. The stats of the fetch; DataError naming what failed."""
    again: tuple[str, ...] = ()
    if store is not None:
        progress(f"data: kept on the cluster's volume ({data_dir(host, fetch.listing.source, store)}): "
                 "the next cluster that mounts it finds it there")
    for attempt in (1, 2):
        result, stats = _fetch_once(s, host, fetch, missing, progress, store)
        changed = [c[0] for c in _items(result, "changed") if isinstance(c, list) and c and isinstance(c[0], str)]
        if not changed:
            _refuse_failed(fetch, host, result)
            return stats.model_copy(update={"changed_again": again})
        if attempt == 2:
            break
        progress(f"data: {len(changed)} object(s) changed while fetched ({_named(changed)}): listing again")
        fetch = replace(fetch, listing=fetch.reader.listing(fetch.listing.source))  # this node's own (threads)
        refuse_unsafe(fetch.listing)
        missing = prepare(s, host, fetch, store)
        again = tuple(changed)
    raise DataError(f"{len(changed)} object(s) of {fetch.listing.source.url} changed while {host.label} fetched them, "
                    f"twice: {_named(changed)}",
                    "Train again once nothing writes to that prefix; what was fetched is kept.")


def _items(result: dict[str, Any], key: str) -> list[Any]:
    value = result.get(key)
    return value if isinstance(value, list) else []


def _named(keys: list[str]) -> str:
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return ", ".join(untrusted.clean(repr(k), 120) for k in keys[:SHOWN]) + more


def _refuse_failed(fetch: Fetch, host: Host, result: dict[str, Any]) -> None:
    url = fetch.listing.source.url
    if result.get("error") == "short":
        raise DataError(f"{url} does not fit on {host.label} any more (another fetch or run filled its disk)",
                        "Free space there (`gpuctl runs rm`), then train again: what was fetched is kept.")
    failed = [f for f in _items(result, "failed") if isinstance(f, list) and len(f) == 2]
    refused = [f for f in _items(result, "refused") if isinstance(f, list) and len(f) == 2]
    if refused:  # the listing here refused them already: a host that says so is named as it said
        raise DataError(f"{host.label} refused {len(refused)} key(s) of {url}: {_named([str(r[0]) for r in refused])}")
    if failed:
        what = "; ".join(f"{untrusted.clean(repr(str(k)), 120)}: {untrusted.clean(str(why), 200)}"
                         for k, why in failed[:SHOWN])
        hint = ("The cluster's role was allowed exactly this prefix: a 403 means the permissions boundary "
                "gpuctl-checkpoint-boundary does not allow s3:GetObject on this bucket (docs/aws-iam.md). "
                "What was fetched is kept." if fetch.access is not None else
                "Train again: what was fetched is kept, and new links are made (a link past its "
                "`train.data_link_hours` answers 403).")
        raise DataError(f"{len(failed)} object(s) of {url} could not be fetched on {host.label}: {what}", hint)
    if result.get("error"):
        raise DataError(f"the data fetch on {host.label} failed: {untrusted.clean(str(result['error']), 300)}")


def _fetch_once(s: Session, host: Host, fetch: Fetch, missing: list[int], progress: Progress,
                store: str | None = None) -> tuple[dict[str, Any], FetchStats]:
    source = fetch.listing.source
    signer = fetch.reader.signer(fetch.listing, fetch.link_s) if missing and fetch.access is None else None
    plan = _plan(host, fetch, set(missing), sign=True, store=store, signer=signer)
    meta = meta_dir(host, source, store)
    pid = jobs.start_detached(host, _payload(s, host, "fetch", plan), "the data fetch")
    try:
        result = _follow(host, meta, pid, progress)
    finally:
        host.run(["rm", "-f", plan, posixpath.join(meta, f"status.{pid}.json"), posixpath.join(meta, f"result.{pid}.json")],
                 check=False)
    stats = FetchStats(files_total=len(fetch.listing.objects), fetched=_count(result, "fetched"),
                       fetched_bytes=_count(result, "fetched_bytes"), cached=_count(result, "cached"),
                       cached_bytes=_count(result, "cached_bytes"), removed=_count(result, "removed"),
                       retries=_count(result, "retries"), seconds=_count(result, "seconds", float),
                       data_dir=data_dir(host, source, store))
    return result, stats


def _count(result: dict[str, Any], key: str, kind: type = int) -> Any:
    """A number of the host's result, bounded (anything else: 0)."""
    value = result.get(key)
    return kind(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e15 else kind(0)


def _read(host: Host, path: str) -> dict[str, Any] | None:
    try:
        data = untrusted.loads(host.read_bytes(path, 0, 1 << 20))
    except untrusted.Untrusted:
        return None
    return data if isinstance(data, dict) else None


def _follow(host: Host, meta: str, pid: int, progress: Progress) -> dict[str, Any]:
    """The fetch's progress relayed until its result is there (or it ended without one)."""
    pauses = Backoff(0.1, 1.0, timeout_s=FOLLOW_S)
    said = ""
    while True:
        result = _read(host, posixpath.join(meta, f"result.{pid}.json"))
        if result is not None:
            return result
        status = _read(host, posixpath.join(meta, f"status.{pid}.json"))
        if status is not None:
            line = progress_line(status)
            if line and line != said:
                progress(line)
                said = line
        if pauses.expired():
            raise RemoteError(f"the data fetch on {host.label} is still running after {FOLLOW_S / 3600:.0f} h",
                              "It goes on there; train again later (what it fetched is kept).")
        if pauses.elapsed() > 2 and host.run(["kill", "-0", str(pid)], check=False).returncode != 0:
            result = _read(host, posixpath.join(meta, f"result.{pid}.json"))
            if result is not None:
                return result
            raise DataError(f"the data fetch on {host.label} ended without a result (killed?)",
                            "Train again: it goes on where it stopped.")
        pauses.pause()


def progress_line(status: dict[str, Any]) -> str:
    """"data: 1,234/10,000 files, 120.5 MB/1.0 GB, 85.2 MB/s, 11s left" from the payload's status."""
    def num(key: str) -> float:
        v = status.get(key)
        return float(v) if isinstance(v, (int, float)) and 0 <= v < 1e18 else 0.0

    done, total, got, size = num("files_done"), num("files_total"), num("bytes_done"), num("bytes_total")
    rate = num("fetched_bytes") / num("elapsed") if num("elapsed") > 0 else 0.0
    left = f", {(size - got) / rate:.0f}s left" if rate > 0 and size > got else ""
    return (f"data: {done:,.0f}/{total:,.0f} files, {size_text(got)}/{size_text(size)}, "
            f"{rate / 1e6:.1f} MB/s{left}")

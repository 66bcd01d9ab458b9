"""Runs on the host, with gpuctl_fetch.py: the data store's side of a fetch from S3. Which object
paths may become files (`check_rel`, `conflicts`: gpuctl asks them too, before anything starts),
the plan gpuctl writes, the cache of what was fetched (manifest + journal beside the data dir),
what is here already and what is missing (`need`), and what no longer belongs (`remove_stale`).
Stdlib only; Python 3.8+.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from typing import Any, Dict, List, Optional, Set, Tuple

PLAN_VERSION = 2  # 2: links as a template and each object's signature ("link")
MANIFEST_VERSION = 1
MAX_PART = 255  # bytes of one name: ext4, xfs, btrfs
MAX_PATH = 4000  # bytes of a whole relative path (PATH_MAX is 4096 with the directory's own)
RESERVE = 256 << 20  # bytes left free on the disk after the fetch (at most 5% of the disk)

Obj = Tuple[str, int, str, Optional[str]]  # rel, size, etag, url (with the plan's "link": its signature)


class PlanError(Exception):
    pass


def check_rel(rel: str) -> Optional[str]:
    """Why an object's path below the prefix cannot be a file under the data dir, or None."""
    if not rel:
        return "an empty name"
    if rel.startswith("/"):
        return "an absolute path"
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in rel):
        return "a control character"
    if "\\" in rel:
        return "a backslash"
    parts = rel.split("/")
    if any(p in (".", "..") for p in parts):
        return "a '.' or '..' part"
    if any(p == "" for p in parts):
        return "an empty part ('//' or a trailing '/')"
    if any(len(p.encode("utf-8", "surrogatepass")) > MAX_PART for p in parts):
        return "a name over %d bytes" % MAX_PART
    if len(rel.encode("utf-8", "surrogatepass")) > MAX_PATH:
        return "a path over %d bytes" % MAX_PATH
    return None


def conflicts(rels: List[str]) -> Dict[str, str]:
    """Paths that cannot be files because another object's path needs them as a directory
    ('a' and 'a/b'): the longer one refused, with why."""
    files = set(rels)
    out = {}
    for rel in rels:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in files:
                out[rel] = "its directory %s is another object" % "/".join(parts[:i])
                break
    return out


def plain_md5(etag: str) -> bool:
    return len(etag) == 32 and all(c in "0123456789abcdef" for c in etag.lower())


def meta_dir(root: str) -> str:
    root = root.rstrip("/")
    return os.path.join(os.path.dirname(root), "." + os.path.basename(root) + ".gpuctl-fetch")


def part_name(rel: str, etag: str) -> str:
    """A download's name under parts/: of its path and its object's ETag, so that a part of an
    earlier version is never continued with the bytes of a later one."""
    return hashlib.sha1(("%s\0%s" % (rel, etag)).encode("utf-8", "surrogatepass")).hexdigest()


def load_plan(path: str) -> Dict[str, Any]:
    with open(path) as fh:
        return load_plan_data(json.load(fh))


def load_plan_data(plan: Any) -> Dict[str, Any]:
    """The plan checked, its objects as (rel, size, etag, url) tuples (each list replaced by its
    tuple where it is: 100,000 objects are never held twice)."""
    if not isinstance(plan, dict) or plan.get("version") != PLAN_VERSION:
        raise PlanError("not a fetch plan of this gpuctl (version %r)" % (plan.get("version") if isinstance(plan, dict) else None))
    if not isinstance(plan.get("dir"), str) or not os.path.isabs(plan["dir"]):
        raise PlanError("the plan names no data directory")
    link = plan.get("link")
    if link is not None and not (isinstance(link, dict) and all(isinstance(link.get(k), str) for k in ("base", "query"))):
        raise PlanError("the plan's links are not {base, query}")
    objs = plan.get("objects") or []
    if not isinstance(objs, list):
        raise PlanError("the plan's objects are no list")
    for i, item in enumerate(objs):
        rel, size, etag, url = item
        objs[i] = (str(rel), int(size), str(etag), url if isinstance(url, str) else None)
    sign = plan.get("sign")
    if sign is not None and not (isinstance(sign, dict) and all(isinstance(sign.get(k), str) for k in
                                                                  ("imds", "bucket", "prefix", "region", "endpoint"))):
        raise PlanError("the plan's signing is not {imds, bucket, prefix, region, endpoint}")
    return dict(plan, objects=objs)


# --- the cache: manifest + journal ------------------------------------------------------------------


def load_known(meta: str, source: str) -> Dict[str, List[Any]]:
    known = {}  # type: Dict[str, List[Any]]
    try:
        with open(os.path.join(meta, "manifest.json")) as fh:
            data = json.load(fh)
        if isinstance(data, dict) and data.get("version") == MANIFEST_VERSION and data.get("source") == source:
            files = data.get("files")
            if isinstance(files, dict):
                known.update(files)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(meta, "journal")) as fh:
            for line in fh:
                try:
                    rel, size, etag = json.loads(line)
                except ValueError:
                    continue  # the line a kill cut
                known[rel] = [size, etag]
    except OSError:
        pass
    return known


def save_known(meta: str, source: str, files: Dict[str, List[Any]]) -> None:
    fd, tmp = tempfile.mkstemp(prefix="manifest.", dir=meta)
    with os.fdopen(fd, "w") as fh:
        json.dump({"version": MANIFEST_VERSION, "source": source, "files": files}, fh, separators=(",", ":"))
    os.replace(tmp, os.path.join(meta, "manifest.json"))
    try:
        os.unlink(os.path.join(meta, "journal"))
    except OSError:
        pass


def is_cached(root: str, rel: str, size: int, etag: str, known: Dict[str, List[Any]]) -> bool:
    if known.get(rel) != [size, etag]:
        return False
    try:
        st = os.lstat(os.path.join(root, *rel.split("/")))
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == size


def sort_out(plan: Dict[str, Any]) -> Tuple[List[Tuple[int, Obj]], List[Obj], List[List[str]], Dict[str, List[Any]]]:
    """(the objects to fetch with their index in the plan, those here already, [rel, why] of each
    refused, what the cache knows)."""
    root = plan["dir"]
    known = load_known(meta_dir(root), plan.get("source", ""))
    clash = conflicts([o[0] for o in plan["objects"]])
    todo, cached, refused = [], [], []
    for i, obj in enumerate(plan["objects"]):
        why = check_rel(obj[0]) or clash.get(obj[0])
        if why:
            refused.append([obj[0], why])
        elif is_cached(root, obj[0], obj[1], obj[2], known):
            cached.append(obj)
        else:
            todo.append((i, obj))
    return todo, cached, refused, known


def free_bytes(root: str) -> Tuple[int, int]:
    """(bytes free on the disk that holds `root`, bytes to leave free there: RESERVE, or 5% of a
    small disk)."""
    where = root
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    st = os.statvfs(where)
    return st.f_bavail * st.f_frsize, min(RESERVE, st.f_blocks * st.f_frsize // 20)


def need(plan: Dict[str, Any]) -> Dict[str, Any]:
    todo, cached, refused, _ = sort_out(plan)
    parts = os.path.join(meta_dir(plan["dir"]), "parts")
    have = 0
    for _, obj in todo:
        try:
            have += min(os.path.getsize(os.path.join(parts, part_name(obj[0], obj[2]))), obj[1])
        except OSError:
            pass
    free, reserve = free_bytes(plan["dir"])
    return {"missing": [i for i, _ in todo], "need": sum(o[1] for _, o in todo) - have,
            "free": free, "reserve": reserve, "cached": len(cached),
            "cached_bytes": sum(o[1] for o in cached), "refused": refused}


def remove_stale(root: str, wanted: Set[str]) -> int:
    """Remove what DATA_DIR holds that the listing no longer names (files, links, then the
    directories left empty); how many files went."""
    removed = 0
    for top, dirs, files in os.walk(root, topdown=False):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
            path = os.path.join(top, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if rel not in wanted or os.path.islink(path):
                os.unlink(path)
                removed += 1
        if top != root:
            try:
                os.rmdir(top)  # only if empty
            except OSError:
                pass
    return removed


def write_json(path: str, data: Any) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp.", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)

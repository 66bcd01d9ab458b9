"""Runs on the instance: copies a run's directory to its cluster's place in the checkpoint store (an
S3 bucket) and back, so that checkpoints and reports outlive a spot interruption.

    python gpuctl_store.py push DIR TARGET_JSON KEY_PREFIX [--delete]
    python gpuctl_store.py pull DIR TARGET_JSON KEY_PREFIX

TARGET_JSON is the store target as gpuctl writes it (a JSON object, or the path of a file holding
one): {"kind": "s3", "bucket", "prefix", "region", "endpoint"?}. KEY_PREFIX is where the directory
goes in the bucket: the target's prefix + "runs/RUN_ID/" (StoreTarget.run_prefix). Each prints one
line of JSON saying what it did.

Only what changed moves: a manifest in the directory (.gpuctl-store.json) remembers each file's
size, mtime and the ETag S3 gave it, and a file whose size and mtime are as remembered and whose
object still has that ETag is skipped, so pushing after every epoch uploads that epoch's files
only, and a push right after a pull uploads nothing.

Credentials come from boto3's (or the AWS CLI's) own chain only: on EC2, the instance profile
through the metadata service; nothing secret is ever passed in. boto3 is used where the Python
running this has it; otherwise the AWS CLI (`aws`, which the Base OSS DLAMI ships). Standard
library only at import, Python 3.8+.

Keys read back are untrusted: pull refuses any key that is not a plain relative path under
KEY_PREFIX (`..`, `.`, empty or absolute parts) and never writes outside DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

MANIFEST = ".gpuctl-store.json"
MANIFEST_VERSION = 1


class StoreError(Exception):
    pass


def safe_relative(key, prefix):
    """The part of `key` under `prefix` if it is a plain relative path, else None."""
    if not key.startswith(prefix):
        return None
    rel = key[len(prefix):]
    if not rel or rel.startswith("/") or "\\" in rel or any(ord(c) < 32 or ord(c) == 127 for c in rel):
        return None
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return None
    return rel


def run_prefix(target, run_id):
    """Where a run's files go under the target: as StoreTarget.run_prefix says on gpuctl's side."""
    return "%sruns/%s/" % (target["prefix"], run_id)


def check_target(target, key_prefix):
    """The target as a dict, refused unless it is one gpuctl wrote and KEY_PREFIX is a run's
    prefix inside it."""
    if isinstance(target, str):
        text = target if target.lstrip().startswith("{") else open(target).read()
        target = json.loads(text)
    if not isinstance(target, dict) or target.get("kind", "s3") != "s3":
        raise StoreError("the target is no S3 store target")
    for field in ("bucket", "prefix", "region"):
        if not isinstance(target.get(field), str) or not target[field]:
            raise StoreError("the target has no " + field)
    if target.get("endpoint") is not None and not isinstance(target["endpoint"], str):
        raise StoreError("the target's endpoint is no URL")
    if not key_prefix.endswith("/") or safe_relative(key_prefix[:-1], target["prefix"]) is None:
        raise StoreError("key prefix %r is not a place under the target's prefix %r" % (key_prefix, target["prefix"]))
    return target


# --- the two ways to talk to S3 ------------------------------------------------------------------

# The instance role's credentials come from the metadata service. botocore asks it once, within
# 1 s, by default: a launcher whose CPU the training holds (or a slow boot) can miss that, and the
# checkpoint is then not restored ("Unable to locate credentials"). Patience costs nothing here.
IMDS_PATIENCE = {"metadata_service_timeout": "5", "metadata_service_num_attempts": "3"}


class _Boto3(object):
    def __init__(self, target):
        import boto3
        import botocore.session
        from botocore.config import Config

        options = {"retries": {"mode": "standard", "max_attempts": 8}}
        kwargs = {"region_name": target["region"]}
        if target.get("endpoint"):
            kwargs["endpoint_url"] = target["endpoint"]
            options["s3"] = {"addressing_style": "path"}
        core = botocore.session.get_session()
        for name, value in IMDS_PATIENCE.items():
            if "AWS_" + name.upper() not in os.environ:  # the user's own setting stands
                core.set_config_variable(name, int(value))
        self.s3 = boto3.session.Session(botocore_session=core).client("s3", config=Config(**options), **kwargs)
        self.bucket = target["bucket"]

    def list(self, prefix):
        out = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = (int(obj.get("Size", 0)), obj.get("ETag", ""))
        return out

    def upload(self, path, key):
        self.s3.upload_file(path, self.bucket, key)

    def download(self, key, path):
        self.s3.download_file(self.bucket, key, path)


class _AwsCli(object):
    def __init__(self, target, aws):
        self.base = [aws, "--region", target["region"], "--no-cli-pager"]
        if target.get("endpoint"):
            self.base += ["--endpoint-url", target["endpoint"]]
        self.bucket = target["bucket"]

    def _run(self, args):
        env = dict(os.environ)
        for name, value in IMDS_PATIENCE.items():
            env.setdefault("AWS_" + name.upper(), value)
        proc = subprocess.run(self.base + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, env=env)
        if proc.returncode != 0:
            raise StoreError("aws %s failed (%d): %s" % (" ".join(args[:2]), proc.returncode,
                                                       proc.stderr.strip()[-500:]))
        return proc.stdout

    def list(self, prefix):
        # The CLI follows the pages itself and prints them as one answer.
        text = self._run(["s3api", "list-objects-v2", "--bucket", self.bucket, "--prefix", prefix, "--output", "json"])
        answer = json.loads(text) if text.strip() else {}
        return {o["Key"]: (int(o.get("Size", 0)), o.get("ETag", "")) for o in answer.get("Contents") or []}

    def upload(self, path, key):
        self._run(["s3", "cp", "--only-show-errors", path, "s3://%s/%s" % (self.bucket, key)])

    def download(self, key, path):
        self._run(["s3", "cp", "--only-show-errors", "s3://%s/%s" % (self.bucket, key), path])


def client(target):
    """boto3 where this Python has it, else the AWS CLI."""
    try:
        return _Boto3(target)
    except ImportError:
        pass
    aws = shutil.which("aws")
    if not aws:
        raise StoreError("neither boto3 nor the AWS CLI (aws) is on this machine")
    return _AwsCli(target, aws)


# --- the manifest ----------------------------------------------------------------------------------


def _load_manifest(root, where, manifest=None):
    """`manifest`: its path, where it is not kept in the directory itself (a data set pushed from
    gpuctl's side keeps it in gpuctl's home: the user's directory gets no file of gpuctl's)."""
    try:
        with open(manifest or os.path.join(root, MANIFEST)) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION or data.get("where") != where:
        return {}  # another place in the store (a copy to another cluster): nothing is known there
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def _save_manifest(root, where, files, manifest=None):
    path = manifest or os.path.join(root, MANIFEST)
    fd, tmp = tempfile.mkstemp(prefix=".gpuctl-store.", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as fh:
        json.dump({"version": MANIFEST_VERSION, "where": where, "files": files}, fh, sort_keys=True)
    os.replace(tmp, path)


def _same(entry, size, mtime_ns, etag):
    """Whether the object is the file as the manifest knows it: same size and mtime, and the ETag
    S3 gave it then; a file a cut push journaled as sent (its ETag not learnt yet) by size and
    mtime, the object being there at that size (the caller checks)."""
    return (isinstance(entry, dict) and entry.get("size") == size and entry.get("mtime_ns") == mtime_ns
            and etag is not None and (entry.get("etag") == etag or (entry.get("etag") is None and entry.get("sent"))))


def _journal_path(root, manifest=None):
    """Beside the manifest: one line per file uploaded by a push still under way, so that a push
    cut (Ctrl-C, a kill, a closed laptop) is resumed by the next without sending those again."""
    return (manifest or os.path.join(root, MANIFEST)) + ".sent"


def _load_journal(root, where, manifest, known):
    """`known` with the files a cut push to `where` journaled as sent (a torn last line ignored)."""
    try:
        with open(_journal_path(root, manifest)) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return known
    merged = dict(known)
    for line in lines:
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if (isinstance(item, dict) and item.get("where") == where and isinstance(item.get("rel"), str)
                and isinstance(item.get("size"), int) and isinstance(item.get("mtime_ns"), int)):
            merged[item["rel"]] = {"size": item["size"], "mtime_ns": item["mtime_ns"], "etag": None, "sent": True}
    return merged


def _journal(fh, where, rel, st):
    fh.write(json.dumps({"where": where, "rel": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns}) + "\n")
    fh.flush()


def _walk(root, leave_out=()):
    """(relative path, absolute path, stat) of every regular file under root; links are not
    followed (nothing outside the directory is uploaded), gpuctl's own files and the top-level
    directories named in `leave_out` are left out."""
    for top, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not os.path.islink(os.path.join(top, d))
                         and not (top == root and d in leave_out))
        for name in sorted(files):
            path = os.path.join(top, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if rel == MANIFEST or name.startswith(".gpuctl-store.") or name.startswith(".gpuctl-pull."):
                continue
            st = os.lstat(path)
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            yield rel, path, st


# --- push and pull ---------------------------------------------------------------------------------


def push(local_dir, target, key_prefix, delete=False, store=None, leave_out=(), manifest=None, progress=None):
    """Upload the new and changed files of local_dir under key_prefix, but for its top-level
    directories named in `leave_out`; with `delete`, also remove the objects whose file is gone
    (never the default: a fresh instance pushing before it pulled would empty the run's
    checkpoints). `manifest`: where the manifest lives when not in local_dir; `progress(rel,
    size)` hears each upload before it starts. A summary dict."""
    target = check_target(target, key_prefix)
    root = os.path.realpath(local_dir)
    if not os.path.isdir(root):
        raise StoreError("%s is no directory" % local_dir)
    store = store or client(target)
    where = "%s/%s" % (target["bucket"], key_prefix)
    remote = store.list(key_prefix)
    known = _load_journal(root, where, manifest, _load_manifest(root, where, manifest))
    files, sent, unchanged, sent_bytes = {}, [], 0, 0
    journal = open(_journal_path(root, manifest), "a")
    try:
        for rel, path, st in _walk(root, leave_out):
            key = key_prefix + rel
            if safe_relative(key, key_prefix) is None:
                continue  # a name S3 could not give back safely (a backslash, a control character)
            have = remote.get(key)
            if have is not None and have[0] == st.st_size and _same(known.get(rel), st.st_size, st.st_mtime_ns, have[1]):
                files[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "etag": have[1]}
                unchanged += 1
                continue
            if progress is not None:
                progress(rel, st.st_size)
            store.upload(path, key)  # the stat is from before: a file changed meanwhile goes again next time
            _journal(journal, where, rel, st)
            files[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "etag": None}
            sent.append(rel)
            sent_bytes += st.st_size
    finally:
        journal.close()
    deleted = 0
    if delete:
        gone = [k for k in remote if safe_relative(k, key_prefix) not in files and k.startswith(key_prefix)]
        for key in gone:
            _delete(store, key)
        deleted = len(gone)
    if sent:
        after = store.list(key_prefix)
        for rel in sent:
            files[rel]["etag"] = after.get(key_prefix + rel, (None, None))[1]
    _save_manifest(root, where, files, manifest)
    try:
        os.unlink(_journal_path(root, manifest))  # all it says is in the manifest now
    except OSError:
        pass
    return {"op": "push", "uploaded": len(sent), "unchanged": unchanged, "bytes": sent_bytes, "deleted": deleted,
            "where": "s3://" + where, "files": len(files), "total_bytes": sum(f["size"] for f in files.values())}


def _delete(store, key):
    if hasattr(store, "delete"):  # a store of gpuctl's side (provision/aws/snapshots.py)
        store.delete(key)
    elif isinstance(store, _Boto3):
        store.s3.delete_object(Bucket=store.bucket, Key=key)
    else:
        store._run(["s3", "rm", "--only-show-errors", "s3://%s/%s" % (store.bucket, key)])


def _inside(root, path):
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


# A replacement instance's role credentials are not always served the moment it boots (the
# profile was associated a moment ago), and a network can hiccup: waits between tries, seconds.
REACH_WAITS = (2, 5, 10, 20)


def pull_when_reachable(target, key_prefix, local_dir, log=None, waits=REACH_WAITS):
    """pull(), tried again while the store cannot be reached at all (no credentials yet, no
    answer): its summary, or the last try's exception. `log` hears each wait."""
    for wait in tuple(waits) + (None,):
        try:
            return pull(target, key_prefix, local_dir)
        except Exception as exc:  # boto3's and the CLI's errors alike
            if wait is None:
                raise
            if log is not None:
                log("the store did not answer (%s: %s): trying again in %d s" % (type(exc).__name__, exc, wait))
            time.sleep(wait)


def pull(target, key_prefix, local_dir, store=None):
    """Download the objects under key_prefix into local_dir (those not there as they are already).
    A key that is not a plain relative path is refused (listed in the summary), and nothing is
    written outside local_dir, through a link either. A summary dict."""
    target = check_target(target, key_prefix)
    if not os.path.isdir(local_dir):
        os.makedirs(local_dir)
    root = os.path.realpath(local_dir)
    store = store or client(target)
    where = "%s/%s" % (target["bucket"], key_prefix)
    known = _load_manifest(root, where)
    files, got, unchanged, refused, failed, got_bytes = {}, 0, 0, [], [], 0
    for key, (size, etag) in sorted(store.list(key_prefix).items()):
        rel = safe_relative(key, key_prefix)
        if rel is None or rel == MANIFEST:
            refused.append(key)
            continue
        dest = os.path.join(root, *rel.split("/"))
        parent = os.path.dirname(dest)
        try:
            if os.path.lexists(dest) and (os.path.islink(dest) or not os.path.isfile(dest)):
                raise StoreError("not a plain file here")
            if os.path.isfile(dest):
                st = os.lstat(dest)
                if _same(known.get(rel), st.st_size, st.st_mtime_ns, etag) and st.st_size == size:
                    files[rel] = known[rel]
                    unchanged += 1
                    continue
            if not os.path.isdir(parent):
                os.makedirs(parent)
            if not _inside(root, os.path.realpath(parent)):
                raise StoreError("its directory leads outside")
            fd, tmp = tempfile.mkstemp(prefix=".gpuctl-pull.", dir=parent)
            os.close(fd)
            try:
                store.download(key, tmp)
                os.replace(tmp, dest)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except (OSError, StoreError) as exc:
            failed.append("%s: %s" % (rel, exc))
            continue
        st = os.lstat(dest)
        files[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "etag": etag}
        got += 1
        got_bytes += st.st_size
    _save_manifest(root, where, files)
    return {"op": "pull", "downloaded": got, "unchanged": unchanged, "bytes": got_bytes, "refused": refused,
            "failed": failed, "where": "s3://" + where}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    delete = "--delete" in argv
    args = [a for a in argv if a != "--delete"]
    if len(args) != 4 or args[0] not in ("push", "pull") or (delete and args[0] != "push"):
        sys.stderr.write("usage: gpuctl_store.py push|pull DIR TARGET_JSON KEY_PREFIX [--delete (push)]\n")
        return 2
    op, local_dir, target, key_prefix = args
    try:
        if op == "push":
            summary = push(local_dir, target, key_prefix, delete=delete)
        else:
            summary = pull(target, key_prefix, local_dir)
    except Exception as exc:  # noqa: BLE001 - one line of JSON whatever went wrong (botocore's errors too)
        print(json.dumps({"op": op, "error": "%s: %s" % (type(exc).__name__, exc)}))
        return 1
    print(json.dumps(summary, sort_keys=True))
    if summary.get("refused"):
        sys.stderr.write("refused %d key(s) that would leave %s: %s\n" % (
            len(summary["refused"]), local_dir, ", ".join(summary["refused"][:5])))
    return 1 if summary.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())

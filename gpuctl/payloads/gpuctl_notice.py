"""Spot interruption notices, heard on the instance. Stdlib only; Python 3.8+.

EC2 tells a spot instance two minutes before it takes it away: IMDSv2 `spot/instance-action`
answers 404 until then, and {"action": "terminate"|"stop"|"hibernate", "time": ...} from then on.
A rebalance recommendation (`events/recommendations/rebalance`) may come earlier, with no deadline.
AWS recommends polling every 5 seconds. The watchdog runs `watch` in a thread beside its ticks:
on an interruption it records the notice and asks the jobs to stop (SIGTERM: the launcher ends
training at the batch end, keeps the last epoch's checkpoint and uploads it); a rebalance is only
recorded (status shows it; the run goes on).

Usage: python gpuctl_notice.py ENDPOINT   (one look, JSON on stdout: what `guard show` can use)
"""

import json
import os
import sys
import threading
import time

import gpuctl_protocol  # beside this file on the instance

TOKEN_TTL_S = 21600
ACTION = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
REBALANCE_FILE = "rebalance.json"  # in the guard dir


class Imds(object):
    """An IMDSv2 client: a session token first (PUT), sent with every GET; a new one on 401.
    urllib is imported here, not with the module: the watchdog imports this module on every
    machine, and urllib.request (http.client, email) is a third of its start-up; only a spot
    instance makes an Imds."""

    def __init__(self, endpoint, timeout=2.0):
        self.endpoint = endpoint.rstrip("/")
        self.timeout = timeout
        self.token = None

    def _token(self):
        from urllib.request import Request, urlopen

        req = Request(self.endpoint + "/latest/api/token", method="PUT",
                      headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
        with urlopen(req, timeout=self.timeout) as res:
            return res.read().decode("ascii", "replace").strip()

    def get(self, path):
        """The body at `path`, or None when IMDS says there is none (404)."""
        from urllib.error import HTTPError
        from urllib.request import Request, urlopen

        for attempt in (0, 1):
            if self.token is None:
                self.token = self._token()
            req = Request(self.endpoint + path, headers={"X-aws-ec2-metadata-token": self.token})
            try:
                with urlopen(req, timeout=self.timeout) as res:
                    return res.read(65536).decode("utf-8", "replace")
            except HTTPError as exc:
                if exc.code == 404:
                    return None
                if exc.code == 401 and attempt == 0:
                    self.token = None  # expired or never valid: ask for a new one once
                    continue
                raise
        return None


def _parsed(body, keys):
    """The notice as a dict with only the expected string keys, short. Any answer there is a
    notice (IMDS answers 404 until there is one), but an odd body must not crash the watchdog."""
    try:
        data = json.loads(body)
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    return dict((k, str(data[k])[:64]) for k in keys if k in data)


def look(imds):
    """{"interruption": {...} or None, "rebalance": {...} or None} as IMDS says now."""
    action = imds.get(ACTION)
    rebalance = imds.get(REBALANCE)
    return {
        "interruption": _parsed(action, ("action", "time")) if action is not None else None,
        "rebalance": _parsed(rebalance, ("noticeTime",)) if rebalance is not None else None,
    }


def watch(config, on_interruption, on_rebalance, log, clock=time.time, sleep=time.sleep):
    """Poll while `config()` has a "notice" entry ({"endpoint", "interval_s"}); call each handler
    once for the first notice of its kind. Errors (IMDS unreachable) are logged once per kind of
    error, never raised: the watchdog's other guards must go on."""
    heard = {"interruption": False, "rebalance": False}
    last_error = None
    imds = None
    while True:
        cfg = (config() or {}).get("notice") or {}
        endpoint = cfg.get("endpoint")
        try:
            interval = max(0.5, float(cfg.get("interval_s", 5)))
        except (TypeError, ValueError):
            interval = 5.0
        if endpoint:
            if imds is None or imds.endpoint != endpoint.rstrip("/"):
                imds = Imds(endpoint)
            try:
                seen = look(imds)
                last_error = None
            except Exception as exc:  # URLError, HTTPException, a reset: this thread must live on
                seen = {}
                error = "%s: %s" % (type(exc).__name__, exc)
                if error != last_error:
                    log("notice: cannot ask the metadata service at %s (%s)" % (endpoint, error))
                    last_error = error
            now = clock()
            for kind, handler in (("interruption", on_interruption), ("rebalance", on_rebalance)):
                if seen.get(kind) is not None and not heard[kind]:
                    try:
                        handler(dict(seen[kind], seen_at=now))
                        heard[kind] = True
                    except Exception as exc:  # tried again at the next poll
                        log("notice: handling the %s notice failed (%s: %s)" % (kind, type(exc).__name__, exc))
        sleep(interval)


def start(watchdog, read_json, write_json):
    """Run `watch` for the watchdog in a daemon thread, with its handlers (and its JSON file helpers)."""

    def on_interruption(notice):
        # EC2 takes the instance in two minutes: record it (status and the launcher read it) and
        # ask the jobs to stop at their batch end, keeping the last epoch's checkpoint. A watchdog
        # restarted after that finds it recorded: the jobs were told once.
        if os.path.exists(os.path.join(watchdog.guard_dir, gpuctl_protocol.NOTICE_FILE)):
            return
        write_json(os.path.join(watchdog.guard_dir, gpuctl_protocol.NOTICE_FILE), notice)
        cfg = watchdog.config() or gpuctl_protocol.GuardConfig()
        running = [r.name for r in watchdog.runs(cfg) if r.running]
        watchdog.log("NOTICE spot interruption: %s at %s; stopping %d job(s) at the batch end"
                     % (notice.get("action"), notice.get("time"), len(running)))
        watchdog.signal_jobs(cfg, running, "TERM")

    def on_rebalance(notice):
        write_json(os.path.join(watchdog.guard_dir, REBALANCE_FILE), notice)
        watchdog.log("NOTICE rebalance recommendation at %s: interruption risk is up; the run goes on"
                     % notice.get("noticeTime"))

    def config():
        return read_json(watchdog.config_path)

    thread = threading.Thread(target=watch, args=(config, on_interruption, on_rebalance, watchdog.log))
    thread.daemon = True
    thread.start()
    return thread


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.stderr.write("usage: gpuctl_notice.py ENDPOINT\n")
        sys.exit(2)
    print(json.dumps(look(Imds(sys.argv[1]))))

"""The watchdog's look at a cluster's notebook server (`gpuctl notebook`). Stdlib only; Python 3.8+.

The notebook lives in ROOT/notebook/ (ROOT: the runs dir's parent): `port` says where it listens
on 127.0.0.1, `token` (the owner's alone) what it asks. Its kernels are asked of Jupyter's own
REST API (GET /api/kernels: each kernel's execution_state), with the token, bounded in time and
size: a kernel that is busy (a cell running) is work; an open notebook whose kernels are idle is
not. No notebook, one that ended, or one that does not answer: None (nothing of it counts).
"""

import json
import os

NOTEBOOK_DIR = "notebook"
PORT_FILE, TOKEN_FILE, WARNING_FILE = "port", "token", "idle-warning.json"
ASK_S = 3.0  # a server that takes longer is not counted this look
MAX_ANSWER = 1 << 20


def notebook_dir(runs_dir):
    return os.path.join(os.path.dirname(os.path.abspath(runs_dir)), NOTEBOOK_DIR)


def _small(path, limit=256):
    try:
        with open(path) as fh:
            return fh.read(limit).strip()
    except (OSError, ValueError):
        return ""


def running(folder):
    """(port, token) of a notebook server started and not ended in `folder`; None otherwise."""
    if os.path.exists(os.path.join(folder, "exitcode")):
        return None
    port, token = _small(os.path.join(folder, PORT_FILE), 16), _small(os.path.join(folder, TOKEN_FILE))
    if not port.isdigit() or not 0 < int(port) < 65536 or len(token) < 16:
        return None
    return int(port), token


def kernels(port, token, timeout=ASK_S):
    """[execution_state] of the server's kernels; None when it does not answer (in time, in shape)."""
    # Here, not at the top: `gpuctl status` reads this module's file names, and urllib.request
    # (with http.client, ssl and email) is ~10 ms that a report need not pay.
    import urllib.request

    req = urllib.request.Request("http://127.0.0.1:%d/api/kernels" % port,
                                 headers={"Authorization": "token " + token})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read(MAX_ANSWER + 1)
        if len(body) > MAX_ANSWER:
            return None
        found = json.loads(body.decode("utf-8", "replace"))
    except Exception:  # refused, timed out, 403, not JSON: the server is not counted this look
        return None
    if not isinstance(found, list):
        return None
    return [str(k.get("execution_state", ""))[:32] if isinstance(k, dict) else "" for k in found[:1000]]


def look(runs_dir):
    """{"kernels": n, "busy": n} of the cluster's notebook server; None: none runs or it does not answer."""
    folder = notebook_dir(runs_dir)
    found = running(folder)
    if found is None:
        return None
    states = kernels(*found)
    if states is None:
        return None
    return {"kernels": len(states), "busy": sum(1 for s in states if s == "busy")}

"""`gpuctl --help` and `gpuctl status` must stay fast: none of the heavy libraries may load, and
help loads neither pydantic nor rich (the CLI imports settings, types and render inside commands)."""

import json
import os
import subprocess
import sys

import pytest

HEAVY = ["boto3", "botocore", "fabric", "paramiko", "tensorflow", "keras", "numpy"]
# What a report (status, cost) of ended runs never runs: the push, release, resume and packages
# code, and pathspec (the ignore rules of a push); nor the settings' models (a report works from
# the specs the ledger recorded). Issue 39: tens of ms of every report.
NOT_FOR_REPORTS = ["pathspec", "gpuctl.ops.push", "gpuctl.ops.release", "gpuctl.ops.resume", "gpuctl.ops.packages",
                   "gpuctl.ops.stages", "gpuctl.ops.runs", "gpuctl.config.settings", "gpuctl.config.load",
                   "urllib.request", "http.client"]  # the notebook's look at Jupyter (~10 ms with ssl, email)
# What `status` shows none of: the storage kept outside clusters (cost's and status --all's) and
# the bill's models (read only where a budget was set): ~30 of its ~100 pydantic models.
NOT_FOR_STATUS = ["gpuctl.model.bill", "gpuctl.ops.images", "gpuctl.ops.snapshots", "gpuctl.ops.volumes",
                  "gpuctl.ops.checkpoints", "gpuctl.ops.storage_reports"]
NOT_FOR_HELP = HEAVY + ["pydantic", "pydantic_core", "rich", "gpuctl.ops", "gpuctl.config.settings", "gpuctl.model.records",
                        "gpuctl.cli.render"]

PROBE = """
import json, sys
from gpuctl.cli import cli
try:
    cli(args=sys.argv[1:], prog_name="gpuctl")
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "loaded": sorted(m for m in %r if m in sys.modules)}), file=sys.stderr)
""" % (NOT_FOR_HELP + NOT_FOR_REPORTS + NOT_FOR_STATUS,)


def probe(args, tmp_path):
    env = dict(os.environ, GPUCTL_HOME=str(tmp_path), GPUCTL_PROVIDER="local")
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, timeout=60)
    result = json.loads(proc.stderr.strip().splitlines()[-1])
    assert result["code"] in (0, None), proc.stderr
    return set(result["loaded"])


@pytest.mark.parametrize("args", [["--help"], ["status"], ["status", "--json"], ["cost"], ["config", "show"]])
def test_cli_does_not_import_heavy_libraries(args, tmp_path):
    assert probe(args, tmp_path) & set(HEAVY) == set()


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["cost"], ["cost", "--json"]])
def test_reports_do_not_import_the_push_code(args, tmp_path):
    assert probe(args, tmp_path) & set(NOT_FOR_REPORTS) == set()


@pytest.mark.parametrize("args", [["status"], ["status", "--json"]])
def test_status_builds_no_storage_or_bill_models(args, tmp_path):
    assert probe(args, tmp_path) & set(NOT_FOR_STATUS) == set()


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["up", "--help"], ["cost", "--help"],
                                  ["guard", "set", "--help"]])
def test_help_imports_neither_pydantic_nor_rich(args, tmp_path):
    assert probe(args, tmp_path) == set()

"""`gpuctl --help` and `gpuctl status` must stay fast: none of the heavy libraries may load."""

import json
import os
import subprocess
import sys

import pytest

HEAVY = ["boto3", "botocore", "fabric", "paramiko", "tensorflow", "keras", "numpy"]

PROBE = """
import json, sys
from gpuctl.cli import cli
try:
    cli(args=sys.argv[1:], prog_name="gpuctl")
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": sorted(m for m in %r if m in sys.modules)}), file=sys.stderr)
""" % (HEAVY,)


@pytest.mark.parametrize("args", [["--help"], ["status"], ["status", "--json"], ["cost"], ["config", "show"]])
def test_cli_does_not_import_heavy_libraries(args, tmp_path):
    env = dict(os.environ, GPUCTL_HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, timeout=60)
    result = json.loads(proc.stderr.strip().splitlines()[-1])
    assert result["code"] in (0, None), proc.stderr
    assert result["heavy"] == []

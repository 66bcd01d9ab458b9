"""README command 1, run as a user runs it, and the promise that CI runs README command 2."""

import json
import os
import re
import subprocess

import pytest

from tests.conftest import REPO


def readme_commands():
    block = re.search(r"```\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    return [line.split("#")[0].strip() for line in block.strip().splitlines()]


def test_readme_starts_with_exactly_two_commands_and_ci_runs_the_second():
    assert readme_commands() == ["./scripts/demo", "./scripts/test"]
    ci = (REPO / ".ci" / "run").read_text()
    assert "exec ./scripts/test" in ci


@pytest.mark.tf  # the demo trains ResNet-34
def test_readme_command_1_runs_the_whole_loop(tmp_path):
    env = dict(os.environ, GPUCTL_HOME=str(tmp_path / "home"), DEMO_CLUSTER="e2e-demo",
               DEMO_LIMIT="128", HOME=str(tmp_path))
    proc = subprocess.run([readme_commands()[0]], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Cluster 'e2e-demo' is up" in proc.stdout
    assert "Cluster 'e2e-demo' is down" in proc.stdout
    # The ledger still holds the report: two epochs with real seconds and examples/s.
    gpuctl = REPO / ".venv" / "bin" / "gpuctl"
    cost = json.loads(subprocess.run([gpuctl, "cost", "--json"], env=env, capture_output=True, text=True, check=True).stdout)
    (run,) = cost["runs"]
    assert run["state"] == "succeeded" and run["epochs_planned"] == 2
    assert [e["epoch"] for e in run["epochs"]] == [1, 2]
    for e in run["epochs"]:
        assert e["seconds"] > 0 and e["examples"] == 128 and e["examples_per_s"] > 0
        assert e["epoch_cost_usd"] > 0
    assert cost["clusters"][0]["state"] == "down"

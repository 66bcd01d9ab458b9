"""The questions asked before spending or destroying are said in cli/render/questions.py, from
what the use cases and providers state as records: the providers hold no sentences. The words are
pinned as the providers said them before they moved (the `down` prompt's part on runs' files)."""

from __future__ import annotations

import pytest

from gpuctl.cli.render import questions
from gpuctl.errors import ExitCode
from gpuctl.model.results import DownQuestion
from gpuctl.model.specs import RunFiles


@pytest.mark.parametrize("files, said", [
    (RunFiles(kept="here", where="/h/runs"), "its runs' outputs, checkpoints and logs are kept in /h/runs "
                                             "(`gpuctl pull RUN` still works; `gpuctl runs rm RUN` deletes one)"),
    (RunFiles(kept="on_hosts"), "its runs' files stay on the hosts, in remote.workdir (gpuctl leaves them there)"),
    (RunFiles(kept="in_store"), "its runs' checkpoints, outputs, reports and logs stay in the S3 checkpoint store"),
    (RunFiles(kept="on_instance"), "its runs' outputs and checkpoints are on the instance's disk only and go with "
                                   "it (`gpuctl pull RUN` first)"),
])
def test_what_becomes_of_the_runs_files_is_said_by_where_they_are_kept(files, said):
    assert questions.run_files(files) == said
    assert questions.down(DownQuestion(cluster="c", files=files)) == f"release cluster 'c' and stop its jobs ({said})"


def test_the_runs_only_on_the_instance_are_named_five_at_most():
    q = DownQuestion(cluster="c", files=RunFiles(kept="on_instance"), unpulled=tuple(f"r{i}" for i in range(7)))
    assert questions.down(q).endswith("; 7 run(s) have outputs only on the instance (r0, r1, r2, r3, r4, ...): "
                                      "`gpuctl down c --pull` brings them back first")
    assert questions.down(DownQuestion(cluster="gone")) == "release cluster 'gone' and stop its jobs"


def test_down_without_a_terminal_says_the_local_providers_kept_directory(gpuctl, tmp_path):
    gpuctl("up", "--provider", "local", "-y")
    try:
        res = gpuctl("down", code=ExitCode.USAGE)  # no terminal to ask in: refused, naming what it would do
        kept = tmp_path / "gpuctl-home" / "runs"
        assert (f"refusing to release cluster 'default' and stop its jobs (its runs' outputs, checkpoints and logs "
                f"are kept in {kept} (`gpuctl pull RUN` still works") in res.stderr.replace("\n", " "), res.stderr
    finally:
        gpuctl("down", "-y")

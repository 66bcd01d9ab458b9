"""The questions gpuctl asks before it spends or destroys, in words: what the use cases and the
providers state as records (model/results.py DownQuestion, model/specs.py RunFiles) said here."""

from __future__ import annotations

from gpuctl.model.results import DownQuestion
from gpuctl.model.specs import RunFiles


def run_files(files: RunFiles) -> str:
    """What becomes of a released cluster's runs' files, by where its provider keeps them."""
    if files.kept == "here":
        return (f"its runs' outputs, checkpoints and logs are kept in {files.where} (`gpuctl pull RUN` "
                "still works; `gpuctl runs rm RUN` deletes one)")
    if files.kept == "on_hosts":
        return "its runs' files stay on the hosts, in remote.workdir (gpuctl leaves them there)"
    if files.kept == "in_store":
        return "its runs' checkpoints, outputs, reports and logs stay in the S3 checkpoint store"
    return "its runs' outputs and checkpoints are on the instance's disk only and go with it (`gpuctl pull RUN` first)"


def down(q: DownQuestion) -> str:
    question = f"release cluster {q.cluster!r} and stop its jobs"
    if q.files is None:
        return question
    question += f" ({run_files(q.files)})"
    if q.unpulled:
        ids = ", ".join(q.unpulled[:5]) + (", ..." if len(q.unpulled) > 5 else "")
        question += (f"; {len(q.unpulled)} run(s) have outputs only on the instance ({ids}): `gpuctl down {q.cluster} "
                     "--pull` brings them back first")
    return question

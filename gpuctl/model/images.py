"""Machine images gpuctl bakes, what goes into one, and where an instance keeps its runs' files:
the records the provider contract returns and the ledger keeps."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict


class BakedImage(BaseModel):
    """A machine image gpuctl made (`gpuctl image bake`), as the provider describes it. (Here, not
    in model/records.py: the ImageStore contract below returns it.)"""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, defer_build=True)

    id: str
    region: str
    name: str
    tensorflow: Optional[str] = None  # the version the bake was asked for (2.21), which `up --tf` matches
    tf_installed: Optional[str] = None  # the exact one the bake's preflight saw (2.21.0)
    tf_variant: Optional[str] = None  # "cuda" (TensorFlow saw a GPU) or "cpu" (an --allow-cpu bake)
    base_image: Optional[str] = None  # the image that instance booted
    base_os: Optional[str] = None
    cluster: Optional[str] = None  # the bake's cluster
    packages: Optional[str] = None  # a requirements file baked in over its TensorFlow ("requirements.txt (sha256 1a2b3c4d)")
    created_at: float
    size_gb: float  # of its snapshots: the provisioned size where the data size is not reported
    snapshots: tuple[str, ...] = ()
    state: str = "available"


class BakeContents(BaseModel):
    """What a bake puts into its image: its tags, and what `up` matches them against."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    tensorflow: str  # as asked (--tf 2.21)
    installed: str  # as the preflight saw it (2.21.0), checked against TF_VERSION
    variant: str  # "cuda" or "cpu"
    base_image: str
    packages: Optional[str] = None  # BakedImage's


class StoreTarget(BaseModel):
    """Where an instance keeps its runs' checkpoints and reports, as the payload sees it (written
    into each run's config; gpuctl_store.py). Nothing secret: the instance's own role grants access."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    kind: str = "s3"
    bucket: str
    prefix: str  # the cluster's, ending in "/": a run's files are under PREFIX + "runs/RUN_ID/"
    region: str
    endpoint: Optional[str] = None  # an S3 endpoint other than AWS's own (the tests' moto server)

    def run_prefix(self, run_id: str) -> str:
        return f"{self.prefix}runs/{run_id}/"

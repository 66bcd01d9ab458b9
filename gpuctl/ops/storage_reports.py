"""The reports that carry what is stored outside any cluster (baked images, checkpoints, volumes,
data sets): `cost` and `status --all`. Apart from ops/costs.py so that `status`, which shows none
of it, imports none of their modules and builds none of their models (issue 39: every report's
start-up)."""

from __future__ import annotations

from gpuctl.model.results import CostReport, StatusAll
from gpuctl.ops.checkpoints import CheckpointStorage
from gpuctl.ops.images import ImageStorage
from gpuctl.ops.snapshots import SnapshotStorage
from gpuctl.ops.volumes import VolumeStorage


class CostWithImages(CostReport):
    """`cost`: the clusters and runs, and the baked images' storage (a key of its own, so the
    JSON of earlier versions keeps its meaning: total_usd is still the clusters' total)."""

    images: ImageStorage = ImageStorage()
    # The runs' checkpoints kept in the providers' stores (S3), asked of the stores at each `cost`.
    checkpoints: CheckpointStorage = CheckpointStorage()
    # The volumes (`gpuctl volume`), from the ledger: they outlive clusters, so no cluster's dollars.
    volumes: VolumeStorage = VolumeStorage()
    # The data sets `gpuctl data push` uploaded (S3), from the ledger, the same way.
    data: SnapshotStorage = SnapshotStorage()


class StatusAllWithVolumes(StatusAll):
    """`status --all`: also the volumes, which belong to no cluster (a key of its own)."""

    volumes: VolumeStorage = VolumeStorage()
    data: SnapshotStorage = SnapshotStorage()  # the data sets (`gpuctl data push`), kept the same way

"""The image pieces that need no cloud: version matching, the ledger's images and their storage
cost, and the ls / bake / rm output."""

from __future__ import annotations

import pytest

from gpuctl.model.images import BakedImage
from gpuctl.ops import images
from gpuctl.ops.session import Session
from gpuctl.provision import tf_matches

DAY = 86400.0


@pytest.mark.parametrize("asked, have, ok", [
    ("2.21", "2.21.0", True), ("2.21", "2.21.3", True), ("2.21", "2.21", True), ("2.21", "2.210.0", False),
    ("2.21", "2.2.1", False), ("2.21.0", "2.21.0", True), ("2.21.0", "2.21.1", False), ("2.21", None, False),
])
def test_tf_matches(asked, have, ok):
    assert tf_matches(asked, have) is ok


def _image(image_id: str, created: float, gb: float = 40.0) -> BakedImage:
    return BakedImage(id=image_id, region="us-east-1", name=f"gpuctl-{image_id}", tensorflow="2.21.0",
                      base_image="ami-0ba5e0000000000a2", base_os="ubuntu-22.04", cluster="bake-tf2-21-abcd",
                      created_at=created, size_gb=gb, snapshots=("snap-1",))


def test_the_ledger_keeps_images_and_cost_prices_their_storage(tmp_path):
    s = Session(tmp_path)
    now = 100 * DAY
    s.ledger.put_image(_image("ami-0000000000000000a", now - 30 * DAY))
    s.ledger.put_image(_image("ami-0000000000000000b", now - 73 * DAY, gb=100.0))
    s.ledger.image_removed("us-east-1", "ami-0000000000000000b", at=now - 365 * 3600)  # half a month ago
    assert [(i.id, i.snapshots, r is not None) for i, r in s.ledger.images()] == [
        ("ami-0000000000000000b", ("snap-1",), True), ("ami-0000000000000000a", ("snap-1",), False)]
    st = images.storage(s, now)
    assert st.gb == 40.0 and st.usd_per_month == pytest.approx(2.0)  # only the kept one costs from now on
    # 40 GB for 30 days plus 100 GB for the 73 days less 365 h it existed, at $0.05/GB-month (730 h a month).
    assert st.accrued_usd == pytest.approx(40 * 0.05 * 30 * 24 / 730 + 100 * 0.05 * (73 * 24 - 365) / 730)
    s.close()


def test_the_image_output(capsys):
    info = images.info(_image("ami-0123456789abcdef0", 0.0), now=DAY)
    from gpuctl.cli.render import images as render_images

    render_images.listing(images.ImageList(region="us-east-1", images=(info,)))
    render_images.baked(images.BakeResult(image=info, cluster="bake-tf2-21-abcd", base_image="ami-0ba5e0000000000a2",
                                          seconds=600.0))
    render_images.removed(images.info(_image("ami-0123456789abcdef0", 0.0), removed_at=DAY))
    render_images.listing(images.ImageList(region="us-east-1", images=()))
    out = capsys.readouterr().out
    assert "ami-0123456789abcdef0" in out and "$2.00" in out and "$0.05/GB-month" in out and "2026-11" in out
    assert "Baked ami-0123456789abcdef0" in out and "cluster bake-tf2-21-abcd released" in out
    assert "Removed ami-0123456789abcdef0" in out and "No baked images in us-east-1" in out

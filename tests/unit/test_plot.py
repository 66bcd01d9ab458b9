"""The cost plot's axes: dollars start at zero, so a run that costs little does not look steep."""

from gpuctl.cli.render.plot import figure
from gpuctl.model.results import CostReport, EpochRow, RunCost


def test_the_cost_axes_start_at_zero():
    # Cumulative dollars far from zero: autoscaling alone would start the axis near $5.
    epochs = tuple(EpochRow(epoch=i, seconds=60.0, epoch_cost_usd=0.05, cumulative_usd=5.0 + 0.05 * i)
                   for i in range(1, 5))
    run = RunCost(run_id="r1", cluster="c", state="succeeded", usd_per_hour=3.0, epochs_done=4, epochs=epochs,
                  spent_usd=5.2)
    fig, drawn = figure(CostReport(clusters=(), runs=(run,), total_usd=5.2))
    assert drawn == 1
    for ax in fig.axes:
        bottom, top = ax.get_ylim()
        assert bottom == 0
        assert top >= 5.2

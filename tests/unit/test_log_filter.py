"""TensorFlow's start-up chatter is kept out of `logs`; the script's output and real errors are not.
The lines are TF 2.21's own, captured on this machine with TF_CPP_MIN_LOG_LEVEL=2."""

from gpuctl.ops.log_filter import LineFilter, noise

TF_START = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796038735.056152   23748 port.cc:153] oneDNN custom operations are on. You may see slightly different numerical results due to floating-point round-off errors from different computation orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.
I0000 00:00:1796038735.056539   23748 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
epoch 1/2 loss=0.5
E0000 00:00:1796038739.282139   23748 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)
E0000 00:00:1796038739.3 23748 op_kernel.cc:1830] OP_REQUIRES failed at conv_ops.cc:12 : RESOURCE_EXHAUSTED: OOM
W0000 00:00:1796038739.3 23748 loop_optimizer.cc:933] Skipping loop optimization
Traceback (most recent call last):
"""


def test_start_up_lines_go_real_errors_and_output_stay():
    f = LineFilter(2)
    # Fed in awkward chunks, as a followed log arrives.
    shown = "".join(f.feed(TF_START[i:i + 37]) for i in range(0, len(TF_START), 37)) + f.flush()
    assert shown.splitlines() == [
        "epoch 1/2 loss=0.5",
        "E0000 00:00:1796038739.3 23748 op_kernel.cc:1830] OP_REQUIRES failed at conv_ops.cc:12 : RESOURCE_EXHAUSTED: OOM",
        "Traceback (most recent call last):",
    ]


def test_level_0_shows_everything_and_level_1_keeps_warnings():
    assert LineFilter(0).feed(TF_START) == TF_START
    assert not noise("W0000 00:00:1.0 1 x.cc:1] careful", 1)
    assert noise("W0000 00:00:1.0 1 x.cc:1] careful", 2)
    assert not noise("I like trains", 3)  # not glog's format: the script's own
    assert not noise("I1130 12:01:49.123456 140234 train.py:12] epoch 1 done", 2)  # the script's absl logging


def test_a_partial_last_line_waits_for_its_end():
    f = LineFilter(2)
    assert f.feed("loss=0.4\nI0000 00:00:1.0 1 port.cc:1] one") == "loss=0.4\n"
    assert f.feed("DNN\nlast without newline") == ""
    assert f.flush() == "last without newline"

"""gpuctl: get a TensorFlow training job onto a GPU and off it again without surprise bills."""

__version__ = "0.1.0"

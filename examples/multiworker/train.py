"""A small CNN on scikit-learn's digits across several nodes, written as TensorFlow's multi-worker
tutorial writes it: MultiWorkerMirroredStrategy, the model built and compiled in its scope, fit.

gpuctl sets TF_CONFIG on every node (and TF_USE_LEGACY_KERAS=1: Keras 2, see the README's
"Several nodes"); nothing here knows about gpuctl. Each worker prints a checksum of its weights at
the end: synchronous training leaves the same weights on every node.
"""

import argparse
import hashlib
import json
import os

import numpy as np
import tensorflow as tf


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per worker; the global batch is this x workers")
    p.add_argument("--limit", type=int, default=0, help="use at most this many training samples (0 = all)")
    p.add_argument("--epoch-seconds", type=float, default=0.0,
                   help="sleep this long in each epoch (tests: to act while an epoch runs)")
    return p.parse_args()


def digits(limit):
    from sklearn.datasets import load_digits

    data = load_digits()  # ships with scikit-learn: no download
    x = data.images.astype("float32")[..., None] / 16.0
    y = data.target.astype("int64")
    order = np.random.RandomState(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:limit], y[:limit]) if limit else (x, y)


def build():
    model = tf.keras.Sequential([
        tf.keras.layers.Input((8, 8, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])
    model.compile(optimizer=tf.keras.optimizers.Adam(1e-3),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


class Pause(tf.keras.callbacks.Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_epoch_begin(self, epoch, logs=None):
        import time

        time.sleep(self.seconds)


def main():
    args = parse_args()
    tf.keras.utils.set_random_seed(0)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    print(f"worker {task.get('index', 0)} of {workers}", flush=True)
    x, y = digits(args.limit)
    global_batch = args.batch_size * workers
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0).batch(global_batch)
    with strategy.scope():
        model = build()
    callbacks = [Pause(args.epoch_seconds)] if args.epoch_seconds else []
    model.fit(ds, epochs=args.epochs, callbacks=callbacks, verbose=2)
    weights = b"".join(np.asarray(w, dtype="float32").tobytes() for w in model.get_weights())
    print(f"weights checksum: {hashlib.sha256(weights).hexdigest()[:16]}", flush=True)


if __name__ == "__main__":
    main()

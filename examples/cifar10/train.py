"""ResNet-34 on CIFAR-10: the seed article's benchmark, as an unmodified Keras script.

gpuctl needs no change here: its launcher injects the per-epoch cost reporter into `model.fit`.
Defaults follow the article: 32x32x3 input, batch 64, 20 epochs, Adam at 1e-3 halved every 5
epochs, sparse categorical cross-entropy, accuracy. `--data digits` trains on scikit-learn's
bundled digits (real, offline) resized to 32x32x3, so the demo needs no download.
"""

import argparse
import os

import numpy as np
import tensorflow as tf

layers = tf.keras.layers


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", choices=["cifar10", "digits"], default="cifar10",
                   help="cifar10 downloads the data set; digits ships with scikit-learn (offline)")
    p.add_argument("--limit", type=int, default=0, help="use at most this many training samples (0 = all)")
    p.add_argument("--save", default="", help="save the trained model here (.keras)")
    return p.parse_args()


def load(data, limit):
    if data == "cifar10":
        (x_train, y_train), (x_test, y_test) = tf.keras.datasets.cifar10.load_data()
        x_train, x_test = x_train.astype("float32") / 255.0, x_test.astype("float32") / 255.0
        y_train, y_test = y_train.reshape(-1), y_test.reshape(-1)
    else:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = digits.images.astype("float32")[..., None] / 16.0  # (n, 8, 8, 1) in [0, 1]
        x = tf.image.resize(x, (32, 32)).numpy()
        x = np.repeat(x, 3, axis=-1)
        y = digits.target.astype("int64")
        order = np.random.RandomState(0).permutation(len(x))
        x, y = x[order], y[order]
        split = int(len(x) * 0.8)
        (x_train, y_train), (x_test, y_test) = (x[:split], y[:split]), (x[split:], y[split:])
    if limit:
        x_train, y_train = x_train[:limit], y_train[:limit]
        x_test, y_test = x_test[: max(limit // 4, 1)], y_test[: max(limit // 4, 1)]
    return (x_train, y_train), (x_test, y_test)


def dataset(x, y, batch_size, training):
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if training:
        ds = ds.shuffle(min(len(x), 10000), seed=0)
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def basic_block(x, filters, stride):
    shortcut = x
    x = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization()(x)
    x = layers.ReLU()(x)
    x = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization()(x)
    if stride != 1 or shortcut.shape[-1] != filters:
        shortcut = layers.Conv2D(filters, 1, strides=stride, use_bias=False)(shortcut)
        shortcut = layers.BatchNormalization()(shortcut)
    return layers.ReLU()(layers.Add()([x, shortcut]))


def resnet34(input_shape=(32, 32, 3), classes=10):
    """ResNet-34 ([3, 4, 6, 3] basic blocks) with the CIFAR stem: one 3x3 conv, no max-pool."""
    inputs = layers.Input(shape=input_shape)
    x = layers.Conv2D(64, 3, padding="same", use_bias=False)(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.ReLU()(x)
    for stage, (filters, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for block in range(blocks):
            x = basic_block(x, filters, 2 if (block == 0 and stage > 0) else 1)
    x = layers.GlobalAveragePooling2D()(x)
    # float32 output keeps softmax stable when gpuctl turns on mixed precision.
    outputs = layers.Dense(classes, activation="softmax", dtype="float32")(x)
    return tf.keras.Model(inputs, outputs, name="resnet34")


def main():
    args = parse_args()
    (x_train, y_train), (x_test, y_test) = load(args.data, args.limit)
    print("data: %s, %d train / %d test samples" % (args.data, len(x_train), len(x_test)), flush=True)
    model = resnet34()
    model.compile(
        optimizer=tf.keras.optimizers.Adam(args.lr),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    halve_every_5 = tf.keras.callbacks.LearningRateScheduler(lambda epoch: args.lr * 0.5 ** (epoch // 5))
    model.fit(
        dataset(x_train, y_train, args.batch_size, True),
        validation_data=dataset(x_test, y_test, args.batch_size, False),
        epochs=args.epochs,
        shuffle=False,  # the tf.data pipeline shuffles; Keras's own flag would only warn
        callbacks=[halve_every_5],
        verbose=2,
    )
    if args.save:
        path = args.save
        if not os.path.isabs(path) and os.environ.get("GPUCTL_OUTPUT_DIR"):
            path = os.path.join(os.environ["GPUCTL_OUTPUT_DIR"], path)
        model.save(path)
        print("saved model to %s" % path)


if __name__ == "__main__":
    main()

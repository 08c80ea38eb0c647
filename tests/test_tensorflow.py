"""TensorFlow and Keras ranks: sparkdl's own examples as users wrote them, locally (np=-2) and on Spark (np=2)."""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest
from rank_lines import tagged_lines

from airflow_provider_hvd import HorovodRunner, RankFailedError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None,
    reason="TensorFlow is not installed: `make setup` installs it (the `tensorflow` extra) before building Horovod",
)

RANKS = "airflow_provider_hvd.ranks"


def sparkdl_examples(epochs: int = 2, tape_steps: int = 30) -> dict:
    """sparkdl's MNIST example (horovod.tensorflow.keras) on generated images, then a DistributedGradientTape loop.

    Each rank seeds its data and initial weights with its rank: only Horovod's broadcast and allreduce can make
    the ranks' weights equal.
    """
    import os

    import horovod.tensorflow as hvd_tf
    import horovod.tensorflow.keras as hvd
    import numpy as np
    import tensorflow as tf

    from airflow_provider_hvd.horovod.tensorflow.keras import LogCallback

    hvd.init()
    tf.random.set_seed(hvd.rank())
    rng = np.random.default_rng(hvd.rank())
    labels = rng.integers(0, 10, 128)
    images = (rng.random((128, 28, 28, 1)) * 0.5 + labels[:, None, None, None] / 20).astype("float32")
    model = tf.keras.Sequential(
        [
            tf.keras.Input((28, 28, 1)),
            tf.keras.layers.Conv2D(4, 3, activation="relu"),
            tf.keras.layers.MaxPooling2D(4),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.Adadelta(learning_rate=1.0 * hvd.size()))
    model.compile(loss="sparse_categorical_crossentropy", optimizer=optimizer, metrics=["accuracy"])
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        LogCallback(),
    ]
    history = model.fit(images, labels, batch_size=32, epochs=epochs, callbacks=callbacks, verbose=0)

    # low-level horovod.tensorflow: fit y = x·(1, -2, 3, 0.5) with a DistributedGradientTape inside tf.function
    true_w = tf.constant([[1.0], [-2.0], [3.0], [0.5]])
    x = tf.random.normal((64, 4), seed=hvd.rank())
    y = x @ true_w
    w = tf.Variable(tf.random.normal((4, 1)))
    sgd = tf.keras.optimizers.SGD(0.1)

    @tf.function
    def step(first: bool) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((x @ w - y) ** 2)
        grads = hvd_tf.DistributedGradientTape(tape).gradient(loss, [w])
        sgd.apply_gradients(zip(grads, [w], strict=True))
        # as in Horovod's examples: broadcast after the first step, once the optimizer has its slots. `first` is a
        # Python bool: AutoGraph cannot convert `if` on a tensor in a function shipped by value (it has no source)
        if first:
            hvd_tf.broadcast_variables([w], root_rank=0)
            hvd_tf.broadcast_variables(sgd.variables(), root_rank=0)
        return loss

    losses = [float(step(i == 0)) for i in range(tape_steps)]
    return {
        "rank": hvd.rank(),
        "history": history.history,
        "histories": hvd_tf.allgather_object(history.history),
        "weights": hvd_tf.allgather_object(model.get_weights()),
        "tape_losses": losses,
        "tape_weights": hvd_tf.allgather_object(w.numpy()),
        "keras": (os.environ.get("TF_USE_LEGACY_KERAS"), tf.keras.layers.Dense.__module__.split(".")[0]),
    }


def sparkdl_examples_and_hosts() -> dict:
    """:func:`sparkdl_examples`, and the host each rank ran on (tests/test_hosts.py)."""
    import socket

    import horovod.tensorflow as hvd

    return {**sparkdl_examples(), "hosts": hvd.allgather_object(socket.gethostname())}


def epoch_lines(caplog) -> list[str]:
    """LogCallback's lines among what reached the driver (local ranks relay all their output, as in sparkdl)."""
    messages = tagged_lines(caplog.records)
    return [m for m in messages if re.match(r"\[rank \d+\] epoch ", m)]


def assert_sparkdl_examples_ran(result: dict, caplog) -> None:
    assert result["rank"] == 0
    assert result["keras"] == ("1", "tf_keras"), "HorovodRunner makes tf.keras Keras 2 (tf-keras) on the ranks"
    first, second = result["weights"]
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True)), "ranks ended with different weights"
    history = result["history"]
    assert set(history) == {"loss", "accuracy"} and len(history["loss"]) == 2
    assert result["histories"][0] == result["histories"][1] == history, "MetricAverageCallback averages the metrics"
    lines = epoch_lines(caplog)
    assert [line.split(":")[0] for line in lines] == [
        "[rank 0] epoch 1/2 begin",
        "[rank 0] epoch 1/2 end",
        "[rank 0] epoch 2/2 begin",
        "[rank 0] epoch 2/2 end",
    ]
    end = re.fullmatch(r"\[rank 0\] epoch 2/2 end: loss=([\d.]+) accuracy=([\d.]+)", lines[3])
    assert end and float(end[1]) == pytest.approx(history["loss"][1], rel=1e-3)

    w0, w1 = result["tape_weights"]
    assert np.array_equal(w0, w1)
    assert w0.ravel() == pytest.approx([1.0, -2.0, 3.0, 0.5], abs=0.05)
    assert result["tape_losses"][-1] < 0.01 * result["tape_losses"][0]


@pytest.fixture
def relayed_lines(caplog):
    caplog.set_level("INFO", logger=RANKS)
    return caplog


def test_sparkdl_examples_on_local_ranks(relayed_lines):
    assert_sparkdl_examples_ran(HorovodRunner(np=-2).run(sparkdl_examples), relayed_lines)


def test_sparkdl_examples_on_spark(spark_local, relayed_lines):
    assert_sparkdl_examples_ran(HorovodRunner(np=2).run(sparkdl_examples), relayed_lines)


def keras3_fit_then_horovod_optimizer() -> None:
    """A notebook ported with `import keras` (Keras 3): LogCallback works in its fit; Horovod's optimizer cannot."""
    import os

    os.environ["KERAS_BACKEND"] = "tensorflow"
    import horovod.tensorflow.keras as hvd
    import keras
    import numpy as np

    from airflow_provider_hvd.horovod.keras import LogCallback

    hvd.init()
    x = np.random.default_rng(hvd.rank()).random((64, 4), dtype="float32")
    y = (x.sum(axis=1) > 2).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    model.fit(x, y, epochs=1, batch_size=32, verbose=0, callbacks=[LogCallback()])
    hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))


def test_keras_3_on_a_rank_logs_its_fit_and_is_told_to_use_tf_keras_for_horovod(relayed_lines):
    with pytest.raises(RankFailedError) as info:
        HorovodRunner(np=-2).run(keras3_fit_then_horovod_optimizer)
    message = str(info.value)
    assert "TypeError: horovod's DistributedOptimizer needs a Keras 2 optimizer, but got Keras 3's keras." in message
    assert "Build the model and its optimizer with tf.keras" in message and "TF_USE_LEGACY_KERAS=1" in message
    assert "has no attribute 'ref'" not in message
    lines = epoch_lines(relayed_lines)
    assert len(lines) == 2 and lines[0] == "[rank 0] epoch 1/1 begin"
    assert lines[1].startswith("[rank 0] epoch 1/1 end: loss=")


def test_ranks_get_keras_2_unless_the_user_chose():
    from airflow_provider_hvd.runner.agent.rank_env import rank_environment
    from airflow_provider_hvd.runner.shared.messages import Hello, Start

    hello, start = Hello(host="127.0.0.1", pid=1), Start(rank=0, kind="Horovod", env={}, local_size=1)
    assert rank_environment({}, hello, start, False)["TF_USE_LEGACY_KERAS"] == "1"
    # the rank's own environment: spark.executorEnv.TF_USE_LEGACY_KERAS, or the driver's for local runs
    assert rank_environment({"TF_USE_LEGACY_KERAS": "0"}, hello, start, False)["TF_USE_LEGACY_KERAS"] == "0"

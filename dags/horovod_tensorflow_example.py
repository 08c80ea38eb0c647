"""Train a small tf.keras model on 2 Horovod ranks with @task.horovod, as sparkdl's Keras examples do.

TensorFlow and Horovod are imported inside the task, so this file parses where neither is installed (the
scheduler's host); the ranks need both (docs/tensorflow.md).
"""

from __future__ import annotations

import pendulum
from airflow.sdk import dag, task


@dag(
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["horovod", "example", "tensorflow"],
)
def horovod_tensorflow_example():
    @task.horovod(np=2, conn_id="spark_default")
    def train(epochs: int = 4, lr: float = 0.05) -> dict:
        """Each rank trains on its own shard; Horovod averages the gradients and the epoch metrics."""
        import horovod.tensorflow.keras as hvd
        import numpy as np
        import tensorflow as tf  # tf.keras is Keras 2 here: HorovodRunner sets TF_USE_LEGACY_KERAS=1

        from airflow_provider_hvd.horovod.tensorflow.keras import LogCallback

        hvd.init()
        rng = np.random.default_rng(hvd.rank())
        labels = rng.integers(0, 2, 1024)
        features = (rng.normal(size=(1024, 8)) + labels[:, None] * 1.5).astype("float32")
        model = tf.keras.Sequential(
            [
                tf.keras.Input((8,)),
                tf.keras.layers.Dense(16, activation="relu"),
                tf.keras.layers.Dense(1, activation="sigmoid"),
            ]
        )
        model.compile(
            optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate=lr * hvd.size())),
            loss="binary_crossentropy",
            metrics=["accuracy"],
        )
        history = model.fit(
            features,
            labels,
            batch_size=64,
            epochs=epochs,
            verbose=0,
            callbacks=[
                hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # every rank starts from rank 0's weights
                hvd.callbacks.MetricAverageCallback(),  # epoch metrics averaged over the ranks
                LogCallback(),  # epoch lines in the Airflow task log
            ],
        )
        return {
            "loss": round(float(history.history["loss"][-1]), 4),
            "accuracy": round(float(history.history["accuracy"][-1]), 4),
            "epochs": epochs,
            "ranks": hvd.size(),
        }

    @task
    def report(metrics: dict) -> None:
        print(f"rank 0 result: {metrics}")
        if metrics["accuracy"] < 0.8:
            raise ValueError(f"the model did not learn: {metrics}")

    report(train())


horovod_tensorflow_example()

"""sparkdl's ``sparkdl.horovod.tensorflow.keras.LogCallback`` path (tf.keras with Keras 2, or Keras 3)."""

from airflow_provider_hvd.horovod.keras import LogCallback

__all__ = ["LogCallback"]

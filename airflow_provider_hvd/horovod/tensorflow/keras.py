"""sparkdl's ``sparkdl.horovod.tensorflow.keras.LogCallback`` path (Keras 3, any backend)."""

from airflow_provider_hvd.horovod.keras import LogCallback

__all__ = ["LogCallback"]

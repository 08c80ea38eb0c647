"""sparkdl-compatible paths: ``airflow_provider_hvd.horovod.log_to_driver`` (``sparkdl.horovod.log_to_driver``)."""

from airflow_provider_hvd.runner.rank.control import log_to_driver

__all__ = ["log_to_driver"]

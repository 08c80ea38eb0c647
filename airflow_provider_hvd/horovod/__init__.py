"""sparkdl-compatible paths: ``airflow_provider_hvd.horovod.log_to_driver`` (``sparkdl.horovod.log_to_driver``),
and the progress API beside it: ``log_metrics``, ``report_checkpoint``, ``last_checkpoint``."""

from airflow_provider_hvd.runner.rank.control import log_to_driver
from airflow_provider_hvd.runner.rank.progress import last_checkpoint, log_metrics, report_checkpoint

__all__ = ["last_checkpoint", "log_metrics", "log_to_driver", "report_checkpoint"]

"""What HorovodRunner does not encrypt, said once when the application asks Spark to encrypt its own traffic."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("airflow_provider_hvd.runner")

SPARK_ENCRYPTION_CONF = ("spark.network.crypto.enabled", "spark.ssl.enabled")
_warned = threading.Event()


def spark_encrypts(conf: Callable[[str], str | None]) -> str | None:
    """The setting that makes Spark encrypt its traffic, if one does."""
    return next((key for key in SPARK_ENCRYPTION_CONF if (conf(key) or "").strip().lower() == "true"), None)


def warn_if_spark_encrypted(conf: Callable[[str], str | None]) -> None:
    """Once per process: Spark's traffic is encrypted, the run's own is not."""
    setting = spark_encrypts(conf)
    if setting is None or _warned.is_set():
        return
    _warned.set()
    log.warning(
        "HorovodRunner: %s=true encrypts Spark's own traffic, but not the run's: the driver channel (authenticated "
        "with a per-run secret; it carries the ranks' slots, logs and rank 0's result) and Horovod's Gloo traffic "
        "between the ranks (the tensors) travel unencrypted. Run on a network you trust.",
        setting,
    )

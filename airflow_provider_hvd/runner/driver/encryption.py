"""Whether the application has Spark encrypt its traffic (the driver channel is TLS then: ..shared.tls), and
what HorovodRunner cannot encrypt, said once."""

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
    """Once per process: Spark's traffic and the driver channel are encrypted, Gloo's is not."""
    setting = spark_encrypts(conf)
    if setting is None or _warned.is_set():
        return
    _warned.set()
    log.warning(
        "HorovodRunner: %s=true: Spark's traffic is encrypted, and so is the driver channel (TLS with a certificate "
        "made for each run); Horovod's Gloo traffic between the ranks (the tensors, and its rendezvous) cannot be "
        "encrypted by Horovod and travels unencrypted. Run the ranks on a network you trust.",
        setting,
    )

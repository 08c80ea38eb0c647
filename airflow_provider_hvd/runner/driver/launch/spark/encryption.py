"""Whether the application has Spark encrypt its traffic (the driver channel is TLS then: ....shared.tls), and
what the ranks cannot encrypt, said once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("airflow_provider_hvd.runner")

SPARK_ENCRYPTION_CONF = ("spark.network.crypto.enabled", "spark.ssl.enabled")
_warned: set[str] = set()  # the runners that said it (once per process each)
_warned_lock = threading.Lock()


def spark_encrypts(conf: Callable[[str], str | None]) -> str | None:
    """The setting that makes Spark encrypt its traffic, if one does."""
    return next((key for key in SPARK_ENCRYPTION_CONF if (conf(key) or "").strip().lower() == "true"), None)


def warn_if_spark_encrypted(
    conf: Callable[[str], str | None], runner: str = "HorovodRunner", unencrypted: str = "", /
) -> None:
    """Once per process and runner: Spark's traffic and the driver channel are encrypted, the ranks' own is not
    (``unencrypted``: what travels between them, as the rank kind says it)."""
    setting = spark_encrypts(conf)
    with _warned_lock:
        if setting is None or runner in _warned:
            return
        _warned.add(runner)
    log.warning(
        "%s: %s=true: Spark's traffic is encrypted, and so is the driver channel (TLS with a certificate made for "
        "each run); %s and travels unencrypted. Run the ranks on a network you trust.",
        runner,
        setting,
        unencrypted or "the ranks' own traffic cannot be encrypted by Spark",
    )

"""A connection's Kerberos keytab as a file for Spark (``spark.kerberos.keytab``), for as long as a session uses it.

The ``keytab`` extra holds the keytab in base64, as the apache-spark provider takes it. The file is this
process's own (only this user can read it; the same keytab is written once per process, so that a running
SparkContext's setting matches the next hook's), and it is removed when the session that uses it stops, or
when no session takes it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from airflow_provider_hvd.runner.errors import SettingError

KEYTAB_CONF = "spark.kerberos.keytab"  # what spark-submit's --keytab sets
_PREFIX = "hvd-keytab-"


def keytab_file(conn_id: str, encoded: str) -> str:
    """The keytab of connection ``conn_id``'s ``keytab`` extra, written to a file only this user can read."""
    try:
        keytab = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise SettingError(
            f"Connection {conn_id!r} has a keytab extra that is not base64: give the output of "
            "`base64 -w0 <your.keytab>`, as the apache-spark provider expects."
        ) from None
    digest = hashlib.sha256(keytab).hexdigest()[:16]
    path = Path(tempfile.gettempdir(), f"{_PREFIX}{os.getuid()}-{os.getpid()}-{digest}")
    if not (path.exists() and path.read_bytes() == keytab):
        fd, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")  # one per writer (0600)
        with os.fdopen(fd, "wb") as out:
            out.write(keytab)
        os.replace(staging, path)
    return str(path)


def remove_keytab(conf: Mapping[str, str], unless_used_by: Mapping[str, str] | None = None) -> None:
    """Remove the keytab file that :func:`keytab_file` wrote for ``conf``, unless the settings
    ``unless_used_by`` (a running SparkContext's) name the same file."""
    path = conf.get(KEYTAB_CONF)
    if not path or (unless_used_by is not None and unless_used_by.get(KEYTAB_CONF) == path):
        return
    mine = Path(tempfile.gettempdir(), f"{_PREFIX}{os.getuid()}-{os.getpid()}-")
    if path.startswith(str(mine)):  # a keytab the user gave by path is theirs
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

"""A training function that a DAG file of this folder imports from beside it (``torch_test_dags.py``). Not
installed: a helper module beside the DAG file, it travels with the job by value."""

from __future__ import annotations

import os


def world_size() -> int:
    """The number of processes this rank sees, as torch.distributed's ``env://`` does."""
    return int(os.environ["WORLD_SIZE"])

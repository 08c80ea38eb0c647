"""The rank agent: one per rank, in its Spark task (``np > 0``) or a driver thread (``np < 0``)."""

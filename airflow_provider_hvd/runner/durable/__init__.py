"""Runs that outlive the submitting process (``submit()``, ``attach()``: docs/durable-runs.md).

Over Spark Connect the run's supervisor runs in the cluster, in a one-task operation of a Connect session of
its own (the run's *host*: :mod:`.host`); the client's :mod:`.submit` starts it, and any process that has the
run's id reaches it over the *link* (:mod:`.link`), found in that session's conf. The public face is
:mod:`..jobs` (``Job``, ``JobStatus``, ``attach``).
"""

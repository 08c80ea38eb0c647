"""The rank process: ``python -m airflow_provider_hvd.runner.rank`` runs ``main``.

:mod:`.control` has ``log_to_driver``, :mod:`.progress` the progress reports.
"""

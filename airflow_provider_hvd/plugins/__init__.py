"""Airflow UI plugins of the provider: the "Training" tab of a task instance (:mod:`.training_tab`)."""

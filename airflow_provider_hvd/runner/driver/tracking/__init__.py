"""What a run reports beside its result: its progress (the progress sink) and its MLflow run."""

"""The driver process, by job: ``launch/`` starts the agents (locally, or a Spark barrier job), ``ranks/`` the
rank kinds (Horovod's, torch.distributed's), ``watch/`` the supervisor and the agents' channel, ``verdict/`` how
a run ends and its words, ``tracking/`` the run's progress and MLflow run."""

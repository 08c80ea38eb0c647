"""Starting the agents: the launcher protocol, the local launcher, the Spark launcher (``spark/``), and where
the driver listens."""

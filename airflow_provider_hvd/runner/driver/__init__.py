"""The driver process: the supervisor, the run's outcome, the agent channel, the rendezvous and the launchers."""

"""A run's restarts: the controller above one attempt (a launcher and a supervisor each), and its policy."""

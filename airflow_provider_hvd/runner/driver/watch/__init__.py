"""Watching a run: the supervisor's loop, the agents' channel, the ranks' phases and the stall clock."""

"""What the driver, the agents and the rank processes share: the wire format, the messages, the job's pickling."""

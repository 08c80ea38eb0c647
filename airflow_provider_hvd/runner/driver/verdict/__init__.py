"""How a run ends: its outcome, decided in one place, and the words of its error and warnings."""

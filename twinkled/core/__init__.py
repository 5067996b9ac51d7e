"""The daemon's core: the service commands, the engine core loop and its composed parts (lanes, gather, residency, executor, futures, journal)."""

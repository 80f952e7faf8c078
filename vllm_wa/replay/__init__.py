"""Trace replay: the same queues and controller as the engine, driven by trace time."""

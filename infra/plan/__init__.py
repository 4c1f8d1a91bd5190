"""Decisions derived from a stack spec and the catalog (pure): what to run where, what it costs,
how fast it starts, where the model cache keeps things, which Redis user may touch what."""

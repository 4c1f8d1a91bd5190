"""Tokens: what a request reserves before it goes upstream (reservation, output_bound) and what
its answer used (usage_meter reads the upstream's usage as it is relayed)."""

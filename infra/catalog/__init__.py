"""Facts the rest of infra builds on: data with a source, typed and validated once at load time.

Nothing here reads a stack: a catalog entry is true whatever stack asks.
"""

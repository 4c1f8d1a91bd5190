"""The gateway's Redis client (bounded, gated on outages) and the loader of its Lua scripts."""

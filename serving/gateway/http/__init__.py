"""The ASGI shell: the app factory that wires the gateway's parts together, and the server that
runs it (`python -m serving.gateway`)."""

"""The ASGI shell: the app factory that wires the gateway's parts together, the public app that
hands requests to the request path, and the server that runs it (`python -m serving.gateway`)."""

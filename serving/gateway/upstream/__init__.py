"""The model servers behind the gateway: the proxy that forwards a request and relays its answer,
and the stream that holds a queued request's response open while it waits for a slot."""

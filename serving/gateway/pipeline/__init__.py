"""The request path of the OpenAI routes as one object (`Gateway.handle`), stage after stage."""

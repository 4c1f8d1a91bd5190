"""Whether a request may go on, before it costs anything upstream: the body read within its
bounds, the request checked field by field, media URLs, and the admitter that runs those checks,
the limits and the queue in order."""

"""The stages a request passes before the proxy, each in its own module: authenticate, read the
body within its bounds (body), validate (validation, media_urls), limit (limit_check), queue
(queue_wait); admitter runs them in order and holds what they took until the request is admitted."""

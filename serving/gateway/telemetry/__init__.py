"""What the gateway reports: Prometheus metrics, the access log, and its Redis's memory."""

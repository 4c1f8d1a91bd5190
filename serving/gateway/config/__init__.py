"""The gateway's settings (environment) and the stack's gateway policy (the schema of
`llmstack:gateway` and its `queue` and `batch` sections). Pydantic models only: no I/O."""

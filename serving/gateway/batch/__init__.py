"""OpenAI's Batch API on the gateway's keys: /v1/files and /v1/batches, run at the lowest queue tier.

    api.py      the HTTP handlers (the routes are in serving.gateway.protocol.routes' allowlist)
    lines.py    the input file's lines, checked up front (pure)
    objects.py  file and batch records, OpenAI's objects and output lines
    store.py    state and the lines waiting (a stream per batch, taken in turns) in Redis
    storage.py  file bytes: a local directory or S3
    runner.py   the workers and the sweeper, inside each gateway process
    *.lua       the store's scripts (loaded by serving.gateway.redis.scripts)

The stack's `gateway.batch` schema is serving.gateway.config.batch_policy; how a batch line names
its caller to admission is serving.gateway.admission.batch_caller (the core never imports batch).
"""

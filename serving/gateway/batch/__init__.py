"""OpenAI's Batch API on the gateway's keys: /v1/files and /v1/batches, run at the lowest queue tier.

    api.py      the HTTP handlers (the routes are in serving.gateway.routes' allowlist)
    lines.py    the input file's lines, checked up front (pure)
    objects.py  file and batch records, OpenAI's objects and output lines
    store.py    state and the lines waiting (a stream per batch, taken in turns) in Redis
    storage.py  file bytes: a local directory or S3
    runner.py   the workers and the sweeper, inside each gateway process
    policy.py   the stack's `gateway.batch`
"""

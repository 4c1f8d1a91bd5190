"""Resuming a stream whose replica died: pure pieces the relay calls (docs/gateway.md,
"Resuming a stream").

- `state`: what the gateway records of each chunk it relays (text, token ids, counts per choice);
- `ending`: why the upstream stopped, and whether that may be resumed (a client cut never is);
- `continuation`: the request that continues each unfinished choice, within the original budget;
- `splice`: the continuation's chunks rewritten into the client's stream, usage billed once;
- `policy`: how many resumes, until when, and the error event past them;
- `plan`: the relay's one call when an upstream stream stops, putting the above together.
"""

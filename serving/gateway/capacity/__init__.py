"""A model's capacity that follows its latency target, agreed by every gateway replica in Redis.
The targets and bounds per model are serving.gateway.config.capacity_policy (the stack's
`latency_target`, and what the gateway reads of it).

- `histogram`: latency samples as log-spaced bucket counts, merged across replicas by addition.
- `law`: the control law (AIMD on the latency target), pure.
- `store`: the Redis side (capacity.lua): every replica reports its samples per window, one
  replica at a time (a short lease) runs the law, all read the same capacity.
- `recorder`: what the relay calls per stream (first token, each chunk) and per tick.
- `engine_priority`: vLLM's per-request priority from the tier and the tenant's share.
"""

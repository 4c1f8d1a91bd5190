"""Replica autoscaling on saturation (`autoscaling.policy: saturation` in the stack file).

- `decision`: the thresholds (a stack file block) and the decision, pure.
- `signals`: Serve's `AutoscalingContext` and the gateway's queue figures -> `decision.Signals`.
- `engine_stats`: a vLLM stat logger that keeps the scheduler's latest figures in the replica.
- `replica`: Ray Serve LLM's `LLMServer` that reports them to Serve's autoscaler.
- `gateway_queue`: the gateway's fair queue figures, read from its Redis in the background.
- `policy`: the Serve autoscaling policy (`AutoscalingConfig.policy`) that ties them together.
"""

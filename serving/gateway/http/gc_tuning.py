"""The gateway process's garbage collector, tuned once its startup is done.

Measured (`python -m ops.benchmarks.profile_gateway --native`, the saturated gateway,
non-streamed): the cyclic collector took 12-16% of the gateway's CPU (gc_collect_main 15.8% of
native samples). Two things made it dear:

- the startup heap is large (the imports: pydantic, starlette, aiohttp, redis, OpenTelemetry...)
  and every full collection walks all of it again: 42-59 ms each;
- with ~100 requests in flight, each holding short-lived objects across awaits, collections of
  the young generation keep promoting live request objects, so full collections come often.

`gc.freeze()` moves everything alive at that point to the permanent generation, which no
collection walks: the startup heap leaves every full collection (6.6-8.9% of CPU in GC, from
11.5-15.6%). A larger generation-0 threshold lets a request's objects die by reference count
before a collection sees them, so fewer survive to be promoted (with both: 0.3-0.4%). Reference
counting still frees frozen objects; only cycles among them stay until exit, which is why the
startup's own garbage is collected first.
"""

from __future__ import annotations

import gc


def tune_gc(gen0_threshold: int) -> None:
    """Collect the startup's garbage, freeze what is left, and collect the young generation
    every `gen0_threshold` allocations (the older generations keep their thresholds)."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)

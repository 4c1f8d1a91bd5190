"""What the relay's timer counts of a stream: its first chunk's delay as TTFT, later gaps as ITL,
and of a stream resumed on another replica, not the break (serving.gateway.capacity.recorder)."""

from __future__ import annotations

from serving.gateway.capacity.histogram import bucket_of
from serving.gateway.capacity.recorder import LatencyRecorder


def test_first_chunk_is_ttft_then_gaps_are_itl():
    recorder = LatencyRecorder(["m"])
    timer = recorder.start("m", 0.0)
    for now in (0.2, 0.25, 0.30):
        timer.chunk(now)
    timer.end()
    report = recorder.take("m")
    assert report.ttft == {bucket_of(200.0): 1}
    assert sum(report.itl.values()) == 2 and max(report.itl) == bucket_of(50.0)
    assert report.peak_in_flight == 1 and recorder.in_flight("m") == 0


def test_the_break_before_a_resumed_stream_continues_is_no_sample():
    # 50 ms between tokens, then the replica dies: 5 s until the continuation's first tokens,
    # then 50 ms again. Counted as an ITL, that gap would read as an engine 100x over target.
    recorder = LatencyRecorder(["m"])
    timer = recorder.start("m", 0.0)
    for now in (0.1, 0.15, 0.2):
        timer.chunk(now)
    timer.resumed()
    for now in (5.2, 5.25, 5.3):
        timer.chunk(now)
    timer.end()
    report = recorder.take("m")
    assert report.ttft == {bucket_of(100.0): 1}
    assert report.itl == {bucket_of(50.0): 4}  # two before the break, two after its first chunk


def test_a_stream_cut_before_its_first_token_gives_no_ttft():
    # The continuation's first chunk waited for the dead replica and the new one's prefill: not a TTFT.
    recorder = LatencyRecorder(["m"])
    timer = recorder.start("m", 0.0)
    timer.resumed()
    timer.chunk(8.0)
    timer.chunk(8.05)
    timer.end()
    report = recorder.take("m")
    assert report.ttft == {} and report.itl == {bucket_of(50.0): 1}

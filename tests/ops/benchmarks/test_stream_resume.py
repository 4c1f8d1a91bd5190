"""The stream-resume benchmark's per-stream findings: where an answer first differs from its
reference, against where the kill left it."""

from __future__ import annotations

from ops.benchmarks.stream_resume import StreamResult, first_difference, stream_record


def test_a_difference_is_placed_against_the_resume_point():
    reference = StreamResult(0, text="abcdefgh", usage=(10, 8), finish_reason="length")
    resumed = StreamResult(
        0, text="abcdXfgh", chunk_times=[1.0, 2.0, 5.0], chunk_ends=[2, 4, 8], usage=(10, 8), finish_reason="length"
    )
    record = stream_record(resumed, reference, kill_at=3.0)
    assert (record["first_difference"], record["chars_at_kill"], record["gap_s"]) == (4, 4, 3.0)
    assert record["whole"] and record["usage"] == record["reference_usage"]
    assert first_difference("abc", "abc") is None
    assert first_difference("ab", "abc") == 2  # cut short: differs where it stops
    assert StreamResult(1).chars_before(9.0) == 0


def test_the_kill_waits_for_most_streams_in_flight():
    from ops.benchmarks.stream_resume import kill_point_reached

    streams = [StreamResult(i, chunk_times=[1.0] * 5) for i in range(9)] + [StreamResult(9)]
    assert kill_point_reached(streams, chunks=5, share=0.9)  # one late stream does not hold the kill
    assert not kill_point_reached(streams, chunks=5, share=1.0)
    assert not kill_point_reached(streams, chunks=6, share=0.9)
    streams[0].finish_reason = "length"  # ended: no longer one the kill can interrupt
    assert not kill_point_reached(streams, chunks=5, share=0.9)
    assert kill_point_reached(streams, chunks=5, share=0.8)

"""The report period: `--since Nd` counts today, `--month` is a UTC calendar month cut at now,
and the ledger days read are exactly the days the period touches."""

from __future__ import annotations

from datetime import date, datetime, timezone

import pytest

from ops.llmctl.cost.inputs import CostInputError, days_in, report_window

NOW = datetime(2026, 12, 1, 10, 46, tzinfo=timezone.utc)


def test_since_counts_today_so_far():
    start, end = report_window("30d", None, NOW)
    assert start == datetime(2026, 11, 2, tzinfo=timezone.utc) and end == NOW
    assert len(days_in(start, end)) == 30
    assert report_window(None, None, NOW) == (start, end)  # 30d is the default


def test_months_are_whole_or_cut_at_now():
    start, end = report_window(None, "2026-11", NOW)
    assert (start, end) == (datetime(2026, 11, 1, tzinfo=timezone.utc), datetime(2026, 12, 1, tzinfo=timezone.utc))
    assert days_in(start, end)[-1] == date(2026, 11, 30)  # midnight itself is the next month's
    assert report_window(None, "2026-12", NOW)[1] == NOW
    with pytest.raises(CostInputError, match="not started"):
        report_window(None, "2027-01", NOW)


@pytest.mark.parametrize("since", ["0d", "30", "1w", "-1d"])
def test_since_wants_whole_days(since):
    with pytest.raises(CostInputError, match="whole days"):
        report_window(since, None, NOW)

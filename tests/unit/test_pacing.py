"""``kvmeta.bench.pacing``: Poisson arrival times, and a sender's schedule that keeps each
request's due time when it falls behind."""

from __future__ import annotations

import statistics

import pytest

from kvmeta.bench.pacing import Pacer, arrivals


def test_arrivals_are_random_with_the_asked_mean_rate() -> None:
    gaps = arrivals(200.0, "seed")
    sample = [gaps() for _ in range(20_000)]
    assert abs(statistics.fmean(sample) - 1 / 200) < 0.0002
    # Exponential gaps: the standard deviation equals the mean (a fixed schedule has none).
    assert abs(statistics.pstdev(sample) - 1 / 200) < 0.0003
    assert len(set(sample[:100])) == 100
    assert arrivals(0.0, "seed")() == 0.0  # back to back


def test_arrivals_repeat_for_one_seed_and_differ_between_seeds() -> None:
    one, again, other = arrivals(50.0, "a"), arrivals(50.0, "a"), arrivals(50.0, "b")
    first = [one() for _ in range(10)]
    assert first == [again() for _ in range(10)]
    assert first != [other() for _ in range(10)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_sender_on_time_sleeps_until_each_due_time(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.now += seconds

    monkeypatch.setattr("kvmeta.bench.pacing.time.sleep", sleep)
    pacer = Pacer(10.0, "s", clock)
    due = [pacer.wait() for _ in range(2000)]
    assert due == sorted(due) and len(set(due)) == len(due)
    assert slept == pytest.approx([b - a for a, b in zip([100.0, *due], due, strict=False)])
    # 2,000 requests at 10 per second take about 200 s.
    assert due[-1] - 100.0 == pytest.approx(200.0, rel=0.1)


def test_a_sleep_that_overshoots_counts_from_the_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()

    def sleep(seconds: float) -> None:
        clock.now += seconds + 0.0003  # the timer wakes 300 us late

    monkeypatch.setattr("kvmeta.bench.pacing.time.sleep", sleep)
    pacer = Pacer(10.0, "s", clock)
    first = pacer.wait()
    assert first == clock.now  # the send's time, not the (earlier) due time


def test_a_sender_behind_sends_at_once_and_keeps_the_due_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock()
    monkeypatch.setattr("kvmeta.bench.pacing.time.sleep", lambda s: pytest.fail("slept"))
    pacer = Pacer(1000.0, "s", clock)
    clock.now += 10.0  # a slow answer: about 10,000 requests are due already
    due = [pacer.wait() for _ in range(100)]
    # Sent without sleeping, each reporting when it was due (all in the past): a latency
    # measured from there includes the wait to be sent.
    assert all(100.0 < d < clock.now for d in due)
    assert due == sorted(due)


@pytest.mark.parametrize("rate", [0.0, -1.0, float("nan")])
def test_a_pacer_needs_a_positive_rate(rate: float) -> None:
    with pytest.raises(ValueError, match="rate must be positive"):
        Pacer(rate, "s")

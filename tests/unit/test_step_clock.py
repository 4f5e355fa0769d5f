import pytest

from decoder_client.engines.deadline import StepDeadline
from decoder_client.engines.step_clock import StepClock
from decoder_client.engines.step_stats import StepStats


def test_steps_are_intervals_between_calls_and_pauses_are_not_steps():
    clock = StepClock(idle_s=1.0)
    got = [clock.tick(t) for t in (5.0, 5.1, 5.3, 9.0, 9.25)]
    assert got[0] is None and got[3] is None  # the first call, then a pause of 3.7 s
    assert [round(g, 3) for g in (got[1], got[2], got[4])] == [0.1, 0.2, 0.25]  # counted from the pause's end


def test_a_clock_that_does_not_move_forward_gives_no_step():
    clock = StepClock(idle_s=1.0)
    clock.tick(2.0)
    assert clock.tick(2.0) is None
    assert clock.tick(1.5) is None
    assert clock.tick(1.6) == pytest.approx(0.1)


@pytest.mark.parametrize("idle_s", [0.0, -1.0])
def test_idle_must_be_positive(idle_s):
    with pytest.raises(ValueError):
        StepClock(idle_s)


def test_deadline_and_timings_read_the_same_steps():
    clock, deadline, stats = StepClock(idle_s=1.0), StepDeadline(floor_s=0.001, fraction=0.5, cap_s=1.0), StepStats()
    for now in (0.0, 0.1, 0.2, 5.0, 5.1):  # 100 ms steps around a pause
        interval = clock.tick(now)
        deadline.step(interval)
        stats.record(interval=interval, seconds=0.002, rows=1)
    summary = stats.summary()
    assert summary["steps"] == 5 and summary["step_ms_mean"] == pytest.approx(100.0)
    assert deadline.seconds == pytest.approx(0.05)

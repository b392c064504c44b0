"""Arrival processes and the replay client's clock: rates, trace gaps, and nothing seen before its time."""

from __future__ import annotations

import itertools
import statistics

import pytest

from bm.bench import Replayer
from bm.config import config_from_dict
from bm.engine import Request, Response
from bm.scheduling import FinishReason
from bm.workloads import (
    ArrivalPlan,
    Row,
    Workload,
    arrival_times,
    gamma_arrivals,
    poisson_arrivals,
    trace_arrivals,
)


def bench(**values):
    return config_from_dict({"bench": values}).bench


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def requests(count: int) -> list[Request]:
    return [Request(i, [5, 6, 7], 2, streaming=True) for i in range(count)]


def final(rid: int, replayer: Replayer, tokens: int = 1) -> None:
    replayer.send_response(
        Response(rid, [0] * tokens, final=True, finish_reason=FinishReason.LENGTH, first_scheduled_time=0.0)
    )


def test_poisson_rate_of_a_long_sample_is_within_two_percent_of_the_asked_rate():
    times = poisson_arrivals(20_000, rate=8.0, seed=3)
    assert times[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(times))
    assert (len(times) - 1) / times[-1] == pytest.approx(8.0, rel=0.02)


def test_gamma_keeps_the_rate_and_burstiness_sets_the_spread_of_gaps():
    for shape in (0.25, 1.0, 4.0):
        times = gamma_arrivals(20_000, rate=5.0, burstiness=shape, seed=1)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        mean = statistics.fmean(gaps)
        assert 1 / mean == pytest.approx(5.0, rel=0.04)
        # a gamma gap's coefficient of variation is 1/sqrt(shape): burstier below 1, more regular above
        cv = statistics.pstdev(gaps) / mean
        assert cv == pytest.approx(shape**-0.5, rel=0.06)


def test_same_seed_same_arrivals_and_another_seed_differs():
    assert poisson_arrivals(50, 3.0, seed=7) == poisson_arrivals(50, 3.0, seed=7)
    assert poisson_arrivals(50, 3.0, seed=7) != poisson_arrivals(50, 3.0, seed=8)


def test_trace_replay_keeps_order_and_scales_gaps_from_the_first_row():
    assert trace_arrivals([10.0, 10.5, 12.0, 12.0], time_scale=0.5) == [0.0, 0.25, 1.0, 1.0]


def test_offline_puts_every_request_at_zero():
    assert ArrivalPlan.from_config(bench()).times(4) == [0.0] * 4


def test_arrival_times_give_a_failed_row_without_timestamp_its_predecessors_time():
    rows = [
        Row("line 1", arrival_time=0.0),
        Row("line 2", arrival_time=2.0),
        Row("line 3", error="line 3: malformed JSON"),
        Row("line 4", arrival_time=6.0),
    ]
    times = arrival_times(Workload("bm", "x", rows), bench(trace_timestamps=True, time_scale=2.0))
    assert times == [0.0, 4.0, 4.0, 12.0]


def test_no_request_is_handed_out_before_its_arrival_time():
    clock = FakeClock()
    replayer = Replayer(requests(4), [0.0, 0.5, 0.5, 2.0], clock=clock)
    assert replayer.get_requests(-1) == []  # not started: nothing is visible
    replayer.start()
    assert [r.request_id for r in replayer.get_requests(-1)] == [0]
    clock.t += 0.499
    assert replayer.get_requests(-1) == []
    clock.t += 0.001
    assert [r.request_id for r in replayer.get_requests(1)] == [1]  # max_new honoured
    assert [r.request_id for r in replayer.get_requests(-1)] == [2]
    clock.t += 1.0
    assert replayer.get_requests(-1) == []
    clock.t += 0.5
    assert [r.request_id for r in replayer.get_requests(-1)] == [3]
    for rid, timeline in replayer.timelines.items():
        assert timeline.taken_s is not None and timeline.taken_s >= timeline.arrival_s, rid


def test_concurrency_cap_holds_arrived_requests_until_a_slot_frees_and_measures_from_then():
    clock = FakeClock()
    replayer = Replayer(requests(3), [0.0, 0.0, 0.0], max_concurrency=2, clock=clock)
    replayer.start()
    assert [r.request_id for r in replayer.get_requests(-1)] == [0, 1]
    clock.t += 1.0
    assert replayer.get_requests(-1) == []
    final(0, replayer)
    clock.t += 0.25
    assert [r.request_id for r in replayer.get_requests(-1)] == [2]
    timeline = replayer.timelines[2]
    assert timeline.arrival_s == 0.0 and timeline.send_s == pytest.approx(1.0)
    assert timeline.taken_s == pytest.approx(1.25)


def test_every_token_is_timestamped_and_final_closes_the_request_once():
    clock = FakeClock()
    replayer = Replayer(requests(1), [0.0], clock=clock)
    replayer.start()
    replayer.get_requests(-1)
    clock.t += 0.1
    replayer.send_response(Response(0, [0]))
    clock.t += 0.2
    final(0, replayer, tokens=2)
    final(0, replayer)  # a duplicate final is ignored
    timeline = replayer.timelines[0]
    assert timeline.token_s == pytest.approx([0.1, 0.3, 0.3])
    assert timeline.finish_reason == "length" and replayer.done and replayer.num_finished == 1


def test_fail_unfinished_ends_unsent_requests_with_an_error_and_stops_sending():
    clock = FakeClock()
    replayer = Replayer(requests(3), [0.0, 5.0, 6.0], clock=clock)
    replayer.start()
    replayer.get_requests(-1)
    assert replayer.fail_unfinished("interrupted") == 3
    clock.t += 10
    assert replayer.get_requests(-1) == []
    assert all(t.error == "interrupted" and t.finish_reason == "error" for t in replayer.timelines.values())
    assert replayer.done


def test_decreasing_arrival_times_are_refused():
    with pytest.raises(ValueError, match="must not decrease"):
        Replayer(requests(2), [1.0, 0.5])

"""The one driver of the engine core: admission with its refusals, routing, stop signals, cancel-all,
and failing sinks that never stop a round."""

from __future__ import annotations

from bm.config import config_from_dict
from bm.engine.driving.driver import Driver
from bm.engine.execution.fake_executor import FakeExecutor
from bm.engine.requests.request import Request, Response
from bm.engine.step.core import EngineCore
from bm.scheduling import FinishReason


def make_driver(max_batch_size: int = 2, **kwargs):
    config = config_from_dict(
        {"engine": {"max_batch_size": max_batch_size}, "kv_cache": {"max_tokens": 256, "tokens_per_block": 4}}
    )
    responses: list[Response] = []
    core = EngineCore(config, FakeExecutor(100), check_integrity=True)
    return Driver(core, responses.append, **kwargs), responses


def run_until_idle(driver: Driver, limit: int = 200) -> None:
    for _ in range(limit):
        if not driver.num_active:
            return
        driver.round([])
    raise AssertionError("requests never finished")


def test_objects_beyond_the_free_slots_and_non_requests_get_their_own_error_and_the_rest_run():
    driver, responses = make_driver(max_batch_size=3)
    driver.round([Request(0, [1, 2], 3), {"request_id": 7}, Request(1, [3], 2), Request(2, [4], 2)])
    errors = {r.request_id: r.error for r in responses if r.error}
    assert "not an InferenceRequest or a bm Request" in errors[7]
    assert "accepts at most 3 new requests now" in errors[2]  # the fourth object of three free slots
    run_until_idle(driver)
    finals = {r.request_id: r for r in responses if r.final and not r.error}
    assert set(finals) == {0, 1} and len(finals[0].output_ids) == 3


def test_stop_signals_are_applied_after_a_step_and_stats_reach_their_sink():
    stopped: list[int] = []
    stats: list[object] = []
    driver, responses = make_driver(poll_stop_signal=lambda: stopped, stats=stats.append)
    driver.round([Request(0, [1, 2], 50)])
    stopped.append(0)
    driver.round([])
    (final,) = [r for r in responses if r.final]
    assert final.finish_reason == FinishReason.CANCELLED and not driver.num_active
    assert len(stats) == 2


def test_cancel_all_ends_every_active_request_and_a_raising_sink_is_only_logged(caplog):
    def broken(_response: Response) -> None:
        raise RuntimeError("client went away")

    driver, _ = make_driver()
    driver._deliver = broken  # the client's callback fails from now on
    driver.round([Request(0, [1], 40), Request(1, [2], 40)])
    driver.round([], cancel=True)
    assert not driver.num_active
    assert "send_response callback failed" in caplog.text

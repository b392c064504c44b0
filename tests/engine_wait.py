"""Bounded waits on the batch manager, so a hang fails and names the requests that are stuck.

A scheduling bug usually shows up as a request that is never scheduled, and the engine then waits for
it forever. These helpers wait for the engine's final responses (an event, not a clock), give up only at
the hang bound of tests/hang.py (no loaded machine reaches it), and list the unfinished request ids.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from bm.batch_manager import InferenceRequest, OfflineClient, generate
from bm.config import BmConfig
from bm.engine.requests.request import Request, Response
from tests.hang import HANG_S

# Seconds to wait for a workload before calling it a hang (tests/hang.py): the largest workload in the
# suite takes about 1.4 s on one core, but at a load average of 5 on 2 cores 10 s was missed by
# workloads that finished, and a bound a slow machine can reach is a flake, not a check.
ENGINE_WAIT_S = HANG_S


def unfinished(client: OfflineClient, request_ids: Iterable[int]) -> list[int]:
    """Ids among ``request_ids`` that have no final response yet."""
    return sorted(set(request_ids) - set(client.results))


def wait_or_fail(client: OfflineClient, request_ids: Iterable[int], timeout: float = ENGINE_WAIT_S) -> None:
    """Wait for every final response; on timeout fail the test naming the stuck requests."""
    ids = list(request_ids)
    if not client.wait(timeout):
        stuck = unfinished(client, ids)
        pytest.fail(
            f"requests {stuck} got no final response within {timeout} s "
            f"({len(ids) - len(stuck)} of {len(ids)} finished): the engine is stuck or starving them",
            pytrace=False,
        )


def generate_or_fail(
    requests: Iterable[Request | InferenceRequest],
    config: BmConfig,
    *,
    timeout: float = ENGINE_WAIT_S,
    **kwargs: Any,
) -> dict[int, Response]:
    """:func:`bm.batch_manager.generate`, but a hang fails the test (not errors it) within ``timeout``,
    with generate's own message naming the unfinished requests."""
    try:
        return generate(requests, config, timeout=timeout, **kwargs)
    except TimeoutError as exc:
        pytest.fail(f"{exc}: the engine is stuck or starving them", pytrace=False)


def wait_until(
    condition: Callable[[], bool], what: Callable[[], str], timeout: float = ENGINE_WAIT_S
) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` s with ``what()`` describing the state."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not reached within {timeout} s: {what()}", pytrace=False)
        time.sleep(0.005)

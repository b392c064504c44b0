"""Small batch-manager clients for tests, built on the public callbacks only."""

from __future__ import annotations

import threading
from collections import deque

import torch

from bm.batch_manager import InferenceRequest, OfflineClient
from tests.engine_wait import ENGINE_WAIT_S, unfinished, wait_or_fail


class StaggeredClient(OfflineClient):
    """Releases ``per_iteration`` requests each time it is asked, so later ones arrive mid-generation."""

    def __init__(self, requests, per_iteration: int = 2) -> None:
        requests = list(requests)
        super().__init__(requests)
        self.request_ids = [r.request_id for r in requests]
        self.per_iteration = per_iteration
        self.max_new_seen: list[int] = []

    def get_requests(self, max_new: int) -> list[InferenceRequest]:
        self.max_new_seen.append(max_new)
        limit = self.per_iteration if max_new < 0 else min(max_new, self.per_iteration)
        return super().get_requests(limit)

    def wait_or_fail(self, timeout: float = ENGINE_WAIT_S) -> None:
        """Wait for every request's final response; fail naming the stuck ones after ``timeout`` s."""
        wait_or_fail(self, self.request_ids, timeout)

    def unfinished(self) -> list[int]:
        return unfinished(self, self.request_ids)


class ScriptedClient:
    """Full control for callback-semantics tests: push requests, record every call."""

    def __init__(self) -> None:
        self.queue: deque[InferenceRequest] = deque()
        self.pushed: list[int] = []
        self.responses: list[tuple[int, dict[str, torch.Tensor], bool, str]] = []
        self.stats: list[str] = []
        self.stop_ids: set[int] = set()
        self.lock = threading.Lock()
        self.finals = threading.Condition(self.lock)

    def push(self, *requests: InferenceRequest) -> None:
        with self.lock:
            self.queue.extend(requests)
            # (a test may push a non-request on purpose: it has no id to wait for)
            self.pushed.extend(r.request_id for r in requests if hasattr(r, "request_id"))

    def get_requests(self, max_new: int) -> list[InferenceRequest]:
        with self.lock:
            count = len(self.queue) if max_new < 0 else min(max_new, len(self.queue))
            return [self.queue.popleft() for _ in range(count)]

    def send_response(self, request_id, tensors, final, error) -> None:
        with self.lock:
            self.responses.append((request_id, tensors, final, error))
            if final:
                self.finals.notify_all()

    def poll_stop_signal(self) -> set[int]:
        with self.lock:
            ids, self.stop_ids = self.stop_ids, set()
            return ids

    def return_stats(self, text: str) -> None:
        with self.lock:
            self.stats.append(text)

    def finals_for(self, request_id: int) -> list[tuple[dict[str, torch.Tensor], str]]:
        with self.lock:
            return [(t, e) for rid, t, f, e in self.responses if rid == request_id and f]

    def wait_finals(self, count: int, timeout: float = ENGINE_WAIT_S) -> None:
        """Wait for ``count`` final responses; fail naming the pushed requests still without one."""
        with self.finals:
            ok = self.finals.wait_for(lambda: sum(1 for r in self.responses if r[2]) >= count, timeout)
            done = {r[0] for r in self.responses if r[2]}
            stuck = [rid for rid in self.pushed if rid not in done]
        assert ok, f"expected {count} final responses within {timeout} s; requests {stuck} have none"

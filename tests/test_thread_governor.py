"""The CPU engine gives cores back while other processes hold them (model.yield_cores), with the same
bits: the thread count follows the machine's load, the results do not."""

from __future__ import annotations

import itertools

import torch

from bm.cpu_load import CpuTicks
from bm.engine.offline import generate
from bm.engine.request import Request
from bm.runtime import executor as executor_module
from bm.runtime.threads import ThreadGovernor, governor_for
from tests.conftest import make_config, random_prompts


class Machine:
    """Two CPUs whose other processes use ``others`` cores' worth over each 100-tick window."""

    def __init__(self) -> None:
        self.others = 0.0
        self.busy = self.total = self.own = 0

    def read(self) -> CpuTicks:
        self.total += 200
        self.busy += 100 + int(self.others * 100)
        self.own += 100
        return CpuTicks(self.busy, self.total, self.own)


def governor(machine: Machine, set_threads, threads: int = 2) -> ThreadGovernor:
    clock = itertools.count(0.0, 1.0)
    return ThreadGovernor(
        threads, 2, window_s=0.5, clock=lambda: next(clock), read=machine.read, set_threads=set_threads
    )


def test_a_busy_core_elsewhere_leaves_one_thread_and_it_comes_back_when_the_load_stops():
    machine, calls = Machine(), []
    gov = governor(machine, calls.append)
    assert gov.tick() == 2 and calls == []  # quiet
    machine.others = 1.0  # a busy loop on one core
    assert gov.tick() == 1 and calls == [1]
    assert gov.tick() == 1 and calls == [1]  # no call while nothing changes
    machine.others = 0.4  # less than half a core: both threads are worth it
    assert gov.tick() == 2 and calls == [1, 2]
    machine.others = 3.0  # more than the machine: never below one thread
    assert gov.tick() == 1
    gov.restore()
    assert calls[-1] == 2 and gov.current == 2 and gov.changes == 3


def test_nothing_is_read_or_changed_within_a_window_or_when_the_load_is_unknown():
    calls = []
    clock = iter([0.0, 0.1, 0.2, 1.0])
    gov = ThreadGovernor(
        2, 2, window_s=0.5, clock=lambda: next(clock), read=lambda: None, set_threads=calls.append
    )
    assert gov.tick() == 2 and gov.tick() == 2 and gov.tick() == 2 and calls == []


def test_the_governor_is_made_only_for_a_cpu_engine_of_two_threads_or_more(threads):
    threads(2)
    assert governor_for("off", "cpu") is None
    assert governor_for("auto", "cuda") is None
    assert governor_for("auto", "cpu") is not None
    threads(1)
    assert governor_for("on", "cpu") is None


def test_greedy_tokens_and_log_probs_are_the_same_bits_while_the_thread_count_moves(
    tiny_model, monkeypatch, threads
):
    """Every step sees a different load, so the engine flips between one and two threads mid-run (prompt
    chunks and decode steps alike); its outputs equal a run at a fixed thread count, bit for bit."""
    threads(2)
    specs = random_prompts(seed=8, count=10, vocab=tiny_model.vocab_size, max_prompt=120, max_output=12)

    def run() -> dict:
        requests = [Request(i, p, m, return_log_probs=True) for i, (p, m) in enumerate(specs)]
        config = make_config(engine={"enable_chunked_context": True, "max_num_tokens": 64})
        results = generate(requests, config, model=tiny_model)
        return {i: (r.output_ids, r.output_log_probs) for i, r in results.items()}

    fixed = run()
    machine, counts = Machine(), []

    def flipping(setting: str, device_type: str) -> ThreadGovernor:
        def set_threads(n: int) -> None:
            counts.append(n)
            torch.set_num_threads(n)

        loads = itertools.cycle([0.0, 1.0])

        def read() -> CpuTicks:
            machine.others = next(loads)
            return machine.read()

        return ThreadGovernor(2, 2, window_s=0.0, read=read, set_threads=set_threads)

    monkeypatch.setattr(executor_module, "governor_for", flipping)
    assert run() == fixed
    assert counts.count(1) >= 3 and counts.count(2) >= 3  # it really moved, both ways
    assert torch.get_num_threads() == 2  # given back when the engine closed

"""The CPU engine gives cores back while other processes hold them (model.yield_cores), with the same
bits: the thread count follows the machine's load, the results do not."""

from __future__ import annotations

import dataclasses
import itertools
import threading

import torch

from bm.batch_manager.offline import generate
from bm.cpu_load import CpuTicks
from bm.engine.requests.request import Request
from bm.runtime import executor as executor_module
from bm.runtime.model_runner import ModelRunner
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


class Clock:
    """A clock that moves only when something sleeps on it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_settling_decides_after_one_window_and_the_next_governor_resumes_that_count_at_once():
    machine, clock, calls = Machine(), Clock(), []
    machine.others = 1.0
    first = ThreadGovernor(2, 2, window_s=0.5, clock=clock, read=machine.read, set_threads=calls.append,
                           sleep=clock.sleep)  # fmt: skip
    assert first.tick() == 2  # within its first window: nothing read yet
    assert first.settle() == 1 and clock.now == 0.5 and calls == [1]
    reading = first.reading()
    first.restore()
    nxt = ThreadGovernor(2, 2, window_s=0.5, clock=clock, read=machine.read, set_threads=calls.append,
                         resume=reading)  # fmt: skip
    assert nxt.current == 1 and calls == [1, 2, 1]  # set on its own (computing) thread when made
    assert nxt.tick() == 1  # within the window it resumed: the count it was handed


def test_an_engines_first_step_computes_on_the_count_the_load_called_for_while_it_was_built(
    tiny_model, monkeypatch, threads
):
    """A busy core elsewhere: every step of the run, the first included, computes on one thread. A
    governor starting afresh on the worker would compute its first window on both (the first
    iteration of every run, 2-10x slower than the next beside a busy process)."""
    threads(2)
    machine, clock = Machine(), Clock()
    machine.others = 1.0

    def busy(setting: str, device_type: str, resume=None) -> ThreadGovernor:
        return ThreadGovernor(2, 2, window_s=0.5, clock=clock, read=machine.read,
                              set_threads=torch.set_num_threads, resume=resume, sleep=clock.sleep)  # fmt: skip

    seen: list[tuple[str, int]] = []
    real = ModelRunner.forward

    def forward(self, items, *args, **kwargs):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return real(self, items, *args, **kwargs)

    monkeypatch.setattr(executor_module, "governor_for", busy)
    monkeypatch.setattr(ModelRunner, "forward", forward)
    model = dataclasses.replace(tiny_model)  # an executor of its own, built (and settled) by this run
    specs = random_prompts(seed=9, count=4, vocab=tiny_model.vocab_size, max_prompt=40, max_output=4)
    generate([Request(i, p, m) for i, (p, m) in enumerate(specs)], make_config(), model=model)
    steps = [count for name, count in seen if name == "bm-batch-manager"]
    assert steps and steps == [1] * len(steps)
    assert torch.get_num_threads() == 2  # the building thread has its count back


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

    def flipping(setting: str, device_type: str, resume=None) -> ThreadGovernor:
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

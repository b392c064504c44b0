"""Run a TensorRT-LLM scheduler test case through bm's real engine loop and compare, iteration by iteration.

A case (see :mod:`tests.conformance.cases_capacity`, :mod:`tests.conformance.cases_micro_batch`) holds a
TRT-LLM unit test's budgets, requests and expected states as plain data. :func:`run_case` builds an
``EngineCore`` over the deterministic ``FakeExecutor`` from those budgets, steps it, and records what each
iteration scheduled. :func:`check_case` then replays the record through :class:`Shadow`, a ledger of each
request as TRT-LLM's ``LlmRequest`` would describe it (prompt length, new-token budget, tokens generated,
context position, all changed by a pause the way ``LlmRequest::pause`` changes them), because that is the
vocabulary the TRT-LLM expectations are written in. The ledger only reads the engine's outputs; it does not
schedule or execute anything itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from bm.config import config_from_dict
from bm.engine.execution.fake_executor import FakeExecutor
from bm.engine.requests.request import Request
from bm.engine.step.core import EngineCore

# A budget that never binds: TRT-LLM's capacity tests run no micro-batch stage (no token limit), and its
# micro-batch tests run no KV cache manager (no block limit).
UNLIMITED_TOKENS = 1 << 20
UNLIMITED_BLOCKS = 4096

POLICIES = {
    "GUARANTEED_NO_EVICT": "guaranteed_no_evict",
    "MAX_UTILIZATION": "max_utilization",
    "STATIC_BATCH": "static_batch",
}
CHUNKING = {"FIRST_COME_FIRST_SERVED": "first_come_first_served", "EQUAL_PROGRESS": "equal_progress"}


def iota(n: int, start: int = 0) -> tuple[int, ...]:
    """``std::iota`` over ``n`` tokens, as TRT-LLM's reuse tests fill their prompts."""
    return tuple(range(start, start + n))


def fill(n: int, value: int) -> tuple[int, ...]:
    return (value,) * n


@dataclass(frozen=True)
class Req:
    """One request. ``prompt``: a length (every token 1, as TRT-LLM's ``createRequest``) or the token ids."""

    id: int
    prompt: int | tuple[int, ...]
    max_new: int
    arrives: int = 0  # the iteration at whose start it is added (TRT-LLM's addNewRequestsCb)
    beam_width: int = 1

    @property
    def tokens(self) -> list[int]:
        return [1] * self.prompt if isinstance(self.prompt, int) else list(self.prompt)


@dataclass(frozen=True)
class Before:
    """TRT-LLM's ``RequestState``, checked at a span's first iteration before it runs.

    ``prompt_len``/``max_new`` include a pause's effect (generated tokens move into the prompt).
    """

    max_new: int
    prompt_len: int
    num_gen: int
    ctx_pos: int = 0


@dataclass(frozen=True)
class After:
    """State after each iteration of a span (the micro-batch tests check after ``forward``).

    ``num_gen`` is the value after the span's first iteration and grows by one each later iteration of
    the span, which is how every TRT-LLM micro-batch test writes it (``it + c``). None: not checked.
    """

    ctx_pos: int | None = None
    num_gen: int | None = None


@dataclass(frozen=True)
class Span:
    """Expectations for iterations ``[begin, end)`` (TRT-LLM's ``ExpectedState`` or an ``if (it ...)`` arm)."""

    begin: int
    end: int
    scheduled: tuple[int, ...] | None = None  # the exact set scheduled (context + generation)
    active: tuple[int, ...] | None = None  # requests added and not finished, in arrival order
    before: Mapping[int, Before] = field(default_factory=dict)
    after: Mapping[int, After] = field(default_factory=dict)
    context: tuple[int, ...] | None = None  # the exact set of context requests
    generation: tuple[int, ...] | None = None
    num_context: int | None = None  # counts only, where the TRT-LLM test asserts no ids
    num_generation: int | None = None
    chunks: Mapping[int, int] | None = None  # context tokens computed this iteration, by request id


@dataclass(frozen=True)
class Case:
    name: str  # the TRT-LLM test name, with [POLICY] where the test loops over policies
    source: str  # file::Suite.Test in NVIDIA/TensorRT-LLM cpp/tests/unit_tests/batch_manager/
    requests: tuple[Req, ...]
    spans: tuple[Span, ...]
    policy: str = "GUARANTEED_NO_EVICT"
    max_batch_size: int = 8
    max_num_tokens: int | None = None  # None: no token budget
    tokens_per_block: int = 10  # also bm's chunk unit (TRT-LLM's chunkUnitSize)
    num_blocks: int | None = None  # None: no block limit
    enable_block_reuse: bool = False
    chunking: str | None = None  # None: chunked context off; else a CHUNKING key
    chunk_size: int | None = None  # TRT-LLM's per-request chunk size / maxContextLength
    max_beam_width: int = 1
    num_iterations: int | None = None  # run to completion, expect this many iterations
    run_iterations: int | None = None  # or stop after this many (a test that calls the scheduler once)
    num_reused_blocks: int | None = None
    reuses_blocks: bool = False  # EXPECT_GT(getNumReusedBlocks(), 0)
    note: str = ""  # how the case maps onto bm, where that is not one-to-one

    def config(self) -> dict:
        engine: dict = {
            "batching_scheme": "inflight_fused",
            "scheduler_policy": POLICIES[self.policy],
            "max_batch_size": self.max_batch_size,
            "max_num_tokens": self.max_num_tokens or UNLIMITED_TOKENS,
            "max_num_active_requests": max(64, len(self.requests)),
            "max_beam_width": self.max_beam_width,
            "enable_chunked_context": self.chunking is not None,
        }
        if self.chunking is not None:
            engine["context_chunking_policy"] = CHUNKING[self.chunking]
            engine["context_chunk_size"] = self.chunk_size
        blocks = self.num_blocks or UNLIMITED_BLOCKS
        kv = {
            "tokens_per_block": self.tokens_per_block,
            "max_tokens": blocks * self.tokens_per_block,
            "enable_block_reuse": self.enable_block_reuse,
        }
        return {"engine": engine, "kv_cache": kv}


@dataclass
class Iteration:
    """What one ``EngineCore.step()`` reported."""

    context_ids: list[int]
    context_chunks: dict[int, int]
    generation_ids: list[int]
    paused_ids: list[int]
    finished_ids: list[int]
    active_before: list[int]  # requests added and not finished when the iteration started


@dataclass
class Run:
    iterations: list[Iteration]
    completed: bool  # every request finished
    num_reused_blocks: int | None


def core_request(request_id: int, tokens: list[int], max_new: int, beam_width: int = 1) -> Request:
    """The engine's typed request for a prompt and a length (the fake executor never samples an end id)."""
    return Request(request_id=request_id, input_ids=tokens, request_output_len=max_new, beam_width=beam_width)


def new_core(config: dict) -> EngineCore:
    """An engine core over the fake executor (no model, no torch)."""
    return EngineCore(config_from_dict(config), FakeExecutor(vocab_size=1000))


def run_case(case: Case, max_iterations: int = 2000) -> Run:
    """Step the real engine core over the fake executor until every request ends (or the case's stop)."""
    core = new_core(case.config())
    arrivals: dict[int, list[Req]] = {}
    for req in case.requests:
        arrivals.setdefault(req.arrives, []).append(req)
    last_arrival = max(arrivals)
    active: list[int] = []
    iterations: list[Iteration] = []
    limit = case.run_iterations or max_iterations
    while len(iterations) < limit:
        it = len(iterations)
        for req in arrivals.get(it, []):
            refused = core.add_request(core_request(req.id, req.tokens, req.max_new, req.beam_width))
            if refused is not None:
                raise AssertionError(f"request {req.id} refused: {refused}")
            active.append(req.id)
        if not active and it > last_arrival:
            break
        out = core.step()
        s = out.schedule
        iterations.append(
            Iteration(
                context_ids=list(s.context_ids),
                context_chunks=dict(s.context_chunks),
                generation_ids=list(s.generation_ids),
                paused_ids=list(s.paused_ids),
                finished_ids=list(out.finished_ids),
                active_before=list(active),
            )
        )
        active = [r for r in active if r not in set(out.finished_ids)]
    kv = core.kv_cache_manager
    reused = getattr(kv, "num_reused_blocks", None)
    return Run(iterations, completed=not active and core.num_active == 0, num_reused_blocks=reused)


@dataclass
class Ledger:
    """One request as TRT-LLM's ``LlmRequest`` would describe it."""

    prompt_len: int
    max_new: int
    num_gen: int = 0
    ctx_pos: int = 0


class Shadow:
    """Replays the recorded iterations into TRT-LLM's per-request view (reads outputs, decides nothing)."""

    def __init__(self, requests: Iterable[Req]) -> None:
        self.ledgers = {r.id: Ledger(len(r.tokens), r.max_new) for r in requests}

    def state(self, rid: int) -> Before:
        led = self.ledgers[rid]
        return Before(led.max_new, led.prompt_len, led.num_gen, led.ctx_pos)

    def apply(self, it: Iteration, ended: set[int]) -> None:
        for rid in it.paused_ids:  # LlmRequest::pause: generated tokens join the prompt
            led = self.ledgers[rid]
            led.prompt_len += led.num_gen
            led.max_new -= led.num_gen
            led.num_gen = 0
            led.ctx_pos = 0
        for rid in it.context_ids:
            led = self.ledgers[rid]
            led.ctx_pos += it.context_chunks.get(rid, 0)
            if rid in ended or led.ctx_pos >= led.prompt_len:
                led.ctx_pos = led.prompt_len  # a reused prefix is part of the context, not computed
                led.num_gen += 1  # the last chunk's logits give the first token
        for rid in it.generation_ids:
            self.ledgers[rid].num_gen += 1


def context_completions(run: Run) -> list[set[int]]:
    """Per iteration, the context requests whose last chunk ran in it.

    The engine reports the tokens it computed; with block reuse a context also takes cached tokens it does
    not compute, so "its chunks reached the prompt length" is not enough. A context ended when the request
    finished in that iteration or next shows up in generation.
    """
    ended: list[set[int]] = []
    for t, it in enumerate(run.iterations):
        done = {rid for rid in it.context_ids if rid in it.finished_ids}
        for rid in it.context_ids:
            for later in run.iterations[t + 1 :]:
                if rid in later.paused_ids or rid in later.context_ids:
                    break
                if rid in later.generation_ids:
                    done.add(rid)
                    break
        ended.append(done)
    return ended


def check_case(case: Case, run: Run) -> list[str]:
    """Every way the run differs from the TRT-LLM expectations; empty when it conforms."""
    errors: list[str] = []
    its = run.iterations
    ended = context_completions(run)
    shadow = Shadow(case.requests)
    for t, it in enumerate(its):
        where = f"iteration {t}"
        for rid in it.context_ids:
            if it.context_chunks.get(rid, 0) <= 0:
                errors.append(f"{where}: context request {rid} scheduled with no tokens")
        for span in case.spans:
            if not span.begin <= t < span.end:
                continue
            errors += _check_span(span, t, it, shadow, where)
        shadow.apply(it, ended[t])
        for span in case.spans:
            if span.begin <= t < span.end:
                for rid, want in span.after.items():
                    got = shadow.state(rid)
                    if want.ctx_pos is not None and got.ctx_pos != want.ctx_pos:
                        errors.append(
                            f"{where}: request {rid} context position {got.ctx_pos}, want {want.ctx_pos}"
                        )
                    if want.num_gen is not None:
                        expect = want.num_gen + (t - span.begin)
                        if got.num_gen != expect:
                            errors.append(f"{where}: request {rid} generated {got.num_gen}, want {expect}")
    if case.num_iterations is not None:
        if not run.completed:
            errors.append(f"requests still active after {len(its)} iterations (want {case.num_iterations})")
        elif len(its) != case.num_iterations:
            errors.append(f"ran {len(its)} iterations, want {case.num_iterations}")
    if case.num_reused_blocks is not None and run.num_reused_blocks != case.num_reused_blocks:
        errors.append(f"reused {run.num_reused_blocks} blocks, want {case.num_reused_blocks}")
    if case.reuses_blocks and not run.num_reused_blocks:
        errors.append(f"reused {run.num_reused_blocks} blocks, want more than 0")
    return errors


def _check_span(span: Span, t: int, it: Iteration, shadow: Shadow, where: str) -> list[str]:
    errors = []
    scheduled = sorted(it.context_ids + it.generation_ids)

    def same(label: str, got: list[int], want: tuple[int, ...] | None) -> None:
        if want is not None and sorted(got) != sorted(want):
            errors.append(f"{where}: {label} {sorted(got)}, want {sorted(want)}")

    same("scheduled", scheduled, span.scheduled)
    same("context", it.context_ids, span.context)
    same("generation", it.generation_ids, span.generation)
    if span.active is not None and it.active_before != list(span.active):
        errors.append(f"{where}: active {it.active_before}, want {list(span.active)}")
    if span.num_context is not None and len(it.context_ids) != span.num_context:
        errors.append(f"{where}: {len(it.context_ids)} context requests, want {span.num_context}")
    if span.num_generation is not None and len(it.generation_ids) != span.num_generation:
        errors.append(f"{where}: {len(it.generation_ids)} generation requests, want {span.num_generation}")
    if span.chunks is not None:
        got = {rid: it.context_chunks.get(rid, 0) for rid in it.context_ids}
        if got != dict(span.chunks):
            errors.append(f"{where}: chunks {got}, want {dict(span.chunks)}")
    if t == span.begin:
        for rid, want in span.before.items():
            if rid not in scheduled:
                continue  # already reported as a scheduling difference
            got = shadow.state(rid)
            if got != want:
                errors.append(f"{where}: request {rid} state {got}, want {want}")
    return errors

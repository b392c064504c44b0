"""Which LoRA adapters are loaded, who holds them, and which to evict: the PEFT cache's bookkeeping.

No tensors here: the executor owns the weights (``load_adapter(slot, spec)`` writes an adapter into one of
``max_adapters`` slots). This class decides, so the engine core and its tests run without a model:

- a request holds its task from admission to its final response, so a queued request's adapter is never
  evicted under it;
- the first request of a task brings the weights; the adapter is *pending* until a slot frees, and every
  request of that task waits (it is not scheduled) until then; it is never failed for that;
- a slot is freed by evicting the least recently used loaded adapter that no active request holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from bm.engine.requests.model_inputs import LoraSpec
from bm.engine.requests.request import RequestError
from bm.scheduling.request import LlmRequest


@dataclass
class _Entry:
    spec: LoraSpec  # the spec that brought the weights
    num_bytes: int
    holders: set[int] = field(default_factory=set)  # request ids
    slot: int | None = None  # None: pending (not loaded yet)


@dataclass
class PeftCacheCounts:
    """What the per-iteration stats report of the cache."""

    loaded: int = 0
    pending: int = 0
    loaded_bytes: int = 0
    waiting_requests: int = 0
    loads: int = 0  # since the engine started
    evictions: int = 0


class PeftCache:
    def __init__(
        self,
        max_adapters: int,
        max_bytes: int | None,
        bytes_per_value: int,
        load: Callable[[int, LoraSpec], None],
    ) -> None:
        self.max_adapters = max_adapters
        self.max_bytes = max_bytes
        self.bytes_per_value = bytes_per_value
        self._load = load
        self._entries: dict[int, _Entry] = {}  # task id -> entry, loaded or pending
        self._lru: OrderedDict[int, None] = OrderedDict()  # loaded task ids, least recently used first
        self._free_slots = list(range(max_adapters - 1, -1, -1))
        self.counts = PeftCacheCounts()

    @staticmethod
    def task_of(request: LlmRequest) -> int | None:
        inputs = request.model_inputs
        return inputs.lora.task_id if inputs is not None and inputs.lora is not None else None

    def admit(self, request: LlmRequest) -> None:
        """Hold the request's task: cached, pending, or brought by this request; else refuse it."""
        spec = request.model_inputs.lora
        entry = self._entries.get(spec.task_id)
        if entry is None:
            if spec.weights is None:
                raise RequestError(
                    f"lora_task_id: task {spec.task_id} is not in the PEFT cache (never loaded, or evicted); "
                    "send lora_weights and lora_config with the request"
                )
            num_bytes = spec.num_values * self.bytes_per_value
            if self.max_bytes is not None and num_bytes > self.max_bytes:
                raise RequestError(
                    f"lora_weights: the adapter of task {spec.task_id} takes {num_bytes} bytes, more than "
                    f"peft_cache.max_bytes ({self.max_bytes}); raise it"
                )
            entry = self._entries[spec.task_id] = _Entry(spec, num_bytes)
        entry.holders.add(request.request_id)

    def release(self, request: LlmRequest) -> None:
        """The request ended: it no longer holds its task (a pending task nobody holds is dropped)."""
        task = self.task_of(request)
        entry = self._entries.get(task) if task is not None else None
        if entry is None:
            return
        entry.holders.discard(request.request_id)
        if entry.slot is None and not entry.holders:
            del self._entries[task]

    def ready(self, request: LlmRequest) -> bool:
        """Whether the request's adapter is loaded, loading it now if a slot can be had."""
        task = self.task_of(request)
        if task is None:
            return True
        entry = self._entries[task]
        if entry.slot is None and not self._make_room(entry):
            return False
        self._lru.move_to_end(task)
        return True

    def ready_requests(self, requests: Iterable[LlmRequest]) -> list[LlmRequest]:
        """The requests that are :meth:`ready`, in order; one without an adapter is, without a call."""
        return [r for r in requests if r.model_inputs is None or self.ready(r)]

    def _make_room(self, entry: _Entry) -> bool:
        while not self._fits(entry):
            victim = next((t for t in self._lru if not self._entries[t].holders), None)
            if victim is None:
                return False
            evicted = self._entries.pop(victim)
            del self._lru[victim]
            self._free_slots.append(evicted.slot)
            self.counts.evictions += 1
        entry.slot = self._free_slots.pop()
        self._load(entry.slot, entry.spec)
        self._lru[entry.spec.task_id] = None
        self.counts.loads += 1
        return True

    def _fits(self, entry: _Entry) -> bool:
        if not self._free_slots:
            return False
        return self.max_bytes is None or self.loaded_bytes + entry.num_bytes <= self.max_bytes

    @property
    def loaded_bytes(self) -> int:
        return sum(self._entries[t].num_bytes for t in self._lru)

    def loaded_tasks(self) -> list[int]:
        """Loaded task ids, least recently used first."""
        return list(self._lru)

    def snapshot(self, waiting_requests: int) -> PeftCacheCounts:
        return PeftCacheCounts(
            loaded=len(self._lru),
            pending=len(self._entries) - len(self._lru),
            loaded_bytes=self.loaded_bytes,
            waiting_requests=waiting_requests,
            loads=self.counts.loads,
            evictions=self.counts.evictions,
        )

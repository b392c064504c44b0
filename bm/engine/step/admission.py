"""Which requests the core admits and which of the admitted the scheduler sees each iteration.

Kept beside the loop, not in it: the checks at admission (an n-sample request where samples cannot
fork, a request the whole cache could never hold) and the gates before scheduling (a LoRA adapter that
cannot be loaded yet, windowed pools sized for a fixed number of requests) are policies of their own,
and each reads only what it is handed. Plain Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable

from bm.engine.execution.peft_cache import PeftCache
from bm.engine.requests.request import RequestError
from bm.kv import KVCacheManager
from bm.scheduling import LlmRequest


def check_samples(*, v1: bool, windowed: bool) -> None:
    """Samples fork one table; V1's static batches and attention windows (blocks released behind the
    window, windowed pools) are not built for it."""
    if v1:
        raise RequestError("num_return_sequences: not supported by the V1 batching scheme; send n lines")
    if windowed:
        raise RequestError("num_return_sequences: not supported with an attention window; send n lines")


def check_fits(request: LlmRequest, kv: KVCacheManager) -> None:
    """Refuse a request the whole cache could never hold to its last token (it would wait for ever)."""
    needed = kv.get_needed_resource_to_completion(request)
    if needed > kv.get_max_resource_count():
        raise RequestError(
            f"the request needs {needed} KV cache blocks (prompt {request.num_prompt_tokens} + output "
            f"{request.max_new_tokens} tokens) but the cache holds {kv.get_max_resource_count()} blocks "
            f"of {kv.tokens_per_block} tokens; raise kv_cache.max_tokens or kv_cache.free_memory_fraction, "
            "or lower request_output_len"
        )


def ready_requests(
    active: Iterable[LlmRequest], peft_cache: PeftCache, kv: KVCacheManager, max_active: int
) -> list[LlmRequest]:
    """The active requests the scheduler sees: not one whose LoRA adapter cannot be loaded yet (every
    slot held), nor, with windowed pools, one beyond what the pools are sized for."""
    ready = peft_cache.ready_requests(active)
    return within_window_pools(ready, kv, max_active) if kv.window_tables else ready


def within_window_pools(ready: list[LlmRequest], kv: KVCacheManager, max_active: int) -> list[LlmRequest]:
    """Windowed pools are sized for ``max_active`` requests holding blocks: beyond that, a request not
    started yet waits unscheduled (the engine loop never queues more anyway)."""
    room = max_active - kv.num_requests
    out = []
    for request in ready:
        if not kv.has_request(request.request_id):
            if room <= 0:
                continue
            room -= 1
        out.append(request)
    return out

"""Custom schedulers, named in the config as ``examples.custom_scheduler:ClassName``.

``ShortestPromptFirstScheduler`` has the shape of the scheduler page's GuaranteedNoEvictScheduler: it
reserves every request's blocks to completion, so nothing is ever evicted, but it admits waiting
requests shortest prompt first instead of first come, first served.

    engine:
      capacity_scheduler: examples.custom_scheduler:ShortestPromptFirstScheduler

The module is looked up on Python's path, then beside the config file, then in the working directory,
so this runs with ``bm run -c cfg.yaml`` from the repository root without ``PYTHONPATH=.``.
"""

from __future__ import annotations

from bm.scheduling import CapacityScheduler, LlmRequest, RequestState


class ShortestPromptFirstScheduler(CapacityScheduler):
    # only schedule requests with no_schedule_until_state <= state < no_schedule_after_state
    no_schedule_until_state = RequestState.CONTEXT_INIT
    no_schedule_after_state = RequestState.GENERATION_COMPLETE

    def __init__(self, max_num_requests: int, kv_cache_manager) -> None:
        super().__init__(max_num_requests, kv_cache_manager)

    def schedule_request(
        self, active_requests: list[LlmRequest]
    ) -> tuple[list[LlmRequest], list[LlmRequest]]:
        scheduled: list[LlmRequest] = []
        pending: list[LlmRequest] = []
        reserved_blocks = 0
        max_blocks = self.kv_cache_manager.get_max_resource_count()
        for request in active_requests:
            if not self.no_schedule_until_state <= request.state < self.no_schedule_after_state:
                continue
            if request.holds_blocks:  # generating, or a context already under way
                scheduled.append(request)
                reserved_blocks += self.kv_cache_manager.get_needed_resource_to_completion(request)
            else:
                pending.append(request)

        available_blocks = max_blocks - reserved_blocks
        for request in sorted(pending, key=lambda r: r.num_prompt_tokens):
            if len(scheduled) >= self.max_num_requests:
                break
            needed_blocks = self.kv_cache_manager.get_needed_resource_to_completion(request)
            if needed_blocks <= available_blocks:
                scheduled.append(request)
                available_blocks -= needed_blocks
        return scheduled, []

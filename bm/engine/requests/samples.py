"""n samples of one prompt (OpenAI's ``n``, TensorRT-LLM's ``num_return_sequences``), without torch.

Sample 0 is the request itself: it computes the prompt once, chunked, paused and resumed like any
request. When its last prompt chunk runs, the engine forks the other samples as sibling requests whose
block tables share the prompt's blocks (:meth:`bm.kv.KVCacheManager.fork_samples`, through the
manager's update step). A sibling starts one position back: its first step recomputes the prompt's last
token into its own copy of the shared tail block and samples its first token from its own generator
(seed from :func:`bm.engine.requests.seeds.sample_seed`), so no sample depends on its siblings or on the
batch. Each sample ends on its own (end token, stop word, length) and frees its table; the request's one final
response carries every sample once the last one ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from bm.engine.requests.request import COUNTERS, Response, SampleOutput
from bm.engine.requests.seeds import sample_seed
from bm.kv import ResourceUpdate
from bm.scheduling import FinishReason, LlmRequest, RequestState


@dataclass
class Family:
    """A request's samples while any runs; ``done``: the final response of each sample that ended."""

    root: LlmRequest
    members: list[LlmRequest]
    done: dict[int, Response] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.members)


def fork_siblings(parent: LlmRequest, sibling_ids: list[int]) -> list[LlmRequest]:
    """Samples 1..n-1 of ``parent``, whose prompt is computed: each holds the prompt but its last token
    (the table the KV manager forks for it) and generates from there with its own seed."""
    siblings = []
    for index, request_id in enumerate(sibling_ids, start=1):
        sibling = LlmRequest(
            request_id=request_id,
            prompt_ids=parent.prompt_ids,
            max_new_tokens=parent.max_new_tokens,
            sampling=replace(parent.sampling, random_seed=sample_seed(parent.sampling.random_seed, index)),
            state=RequestState.GENERATION_IN_PROGRESS,
            num_computed_tokens=parent.num_prompt_tokens - 1,
            arrival_time=parent.arrival_time,
            first_scheduled_time=parent.first_scheduled_time,
            controls=parent.controls,
            output_log_probs=[] if parent.output_log_probs is not None else None,
            output_top_log_probs=[] if parent.output_top_log_probs is not None else None,
            model_inputs=parent.model_inputs,
            num_return_sequences=parent.num_return_sequences,
            sample_index=index,
            sample_parent=parent,
            shares_blocks=True,
        )
        siblings.append(sibling)
    parent.num_pending_samples = 0
    parent.shares_blocks = True
    return siblings


def combined_response(family: Family) -> Response:
    """The request's final response: sample 0's fields, every sample in ``samples``, counters summed;
    an error in any sample is the request's error."""
    responses = [family.done[i] for i in sorted(family.done)]
    first = replace(responses[0], request_id=family.root.request_id)
    first.samples = [
        SampleOutput(i, r.output_ids, r.finish_reason, r.output_log_probs, r.output_top_log_probs)
        for i, r in enumerate(responses)
    ]
    for name in COUNTERS:
        setattr(first, name, sum(getattr(r, name) for r in responses))
    end_id = family.root.sampling.end_id
    first.pad_fill = end_id if end_id >= 0 else family.root.sampling.pad_id
    failed = next((r for r in responses if r.error), None)
    if failed is not None:
        first.error, first.finish_reason = failed.error, FinishReason.ERROR
    return first


class SampleFamilies:
    """Every n-sample request while any of its samples runs: the one place their state lives.

    Siblings get negative internal ids, which no user request can have. A sample's final response is
    kept until its last sibling ends; the request's one final response then carries them all."""

    def __init__(self) -> None:
        self._by_root: dict[int, Family] = {}
        self._next_id = -1

    def __bool__(self) -> bool:
        return bool(self._by_root)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_root

    def root_ids(self) -> list[int]:
        return list(self._by_root)

    def fork(self, parent: LlmRequest, update: ResourceUpdate) -> list[LlmRequest]:
        """``parent``'s prompt is computed: its siblings, whose tables the KV manager forks from its
        blocks in ``update`` (the caller admits them)."""
        ids = list(range(self._next_id, self._next_id - parent.num_pending_samples, -1))
        self._next_id -= len(ids)
        siblings = fork_siblings(parent, ids)
        self._by_root[parent.request_id] = Family(parent, [parent, *siblings])
        update.samples.append((parent.request_id, ids, parent.num_prompt_tokens - 1))
        return siblings

    def settle(self, request: LlmRequest, response: Response) -> Response | None:
        """``request``'s final response as its request's: itself for a plain request; for a sample,
        None until its last sibling has ended, then the request's combined response."""
        root = request.sample_parent or request
        family = self._by_root.get(root.request_id)
        if family is None:
            return response
        family.done[request.sample_index] = response
        if not family.complete:
            return None
        del self._by_root[root.request_id]
        return combined_response(family)

    def members(self, request_id: int) -> list[LlmRequest]:
        """The samples of request ``request_id`` (empty when it has none running)."""
        family = self._by_root.get(request_id)
        return list(family.members) if family is not None else []

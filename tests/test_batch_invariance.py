"""Batch invariance, in the shape of vLLM's test: N prompts run one at a time give per-step log probs (and
logits) bitwise equal to the same prompts run together, on the CPU in float32, with bm's C kernels on,
for every instruction-set build this machine runs (tests/native_variants.py).

It holds because every computation a token goes through is done per row in one fixed order, whatever
else shares the forward: the panel GEMM sums each output over k in one chain; decode attention is one
(row, kv head) at a time; prefill attention cuts tiles within a prompt and aligns its key blocks to
absolute positions, so a chunk after a cached prefix (chunked context, reused blocks, a resumed request)
sums exactly as the whole prompt did; the elementwise chains and the sampler work row by row. The
scenarios below are those where the batch changes most: a small ``max_num_tokens`` budget (every prompt
chunked, chunks meeting other requests' decodes), prompts sharing a prefix with block reuse on (the
prefix's keys read from another request's blocks), and a KV cache so small that max_utilization pauses
requests and later resumes them (their context recomputed in another batch: the prompt as prefill, the
output as decode rows, as they first ran). docs/cpu-kernels.md says where it does not hold.
"""

from __future__ import annotations

import pytest
import torch

from bm.cpu_isa import ENV_ISA, kernel_isa
from bm.engine import BatchManager, InferenceRequest
from bm.runtime import load_model
from bm.runtime.model_loader import ModelConfig
from bm.runtime.native import ENV_SWITCH, paged_decode_kernel
from tests.clients import StaggeredClient
from tests.conftest import make_config
from tests.native_variants import ISAS

pytestmark = pytest.mark.skipif(paged_decode_kernel() is None, reason="bm's C kernels do not build here")

BLOCK = 8
SCENARIOS = {
    "default": {},
    "chunked_context": {"engine": {"enable_chunked_context": True, "max_num_tokens": 16}},
    "block_reuse": {"kv_cache": {"enable_block_reuse": True}},
    # 12 blocks for 8 requests of up to 7 blocks each: max_utilization pauses the latest started
    "pausing": {"engine": {"scheduler_policy": "max_utilization"}, "kv_cache": {"max_tokens": 12 * BLOCK}},
    "all_together": {
        "engine": {
            "scheduler_policy": "max_utilization",
            "enable_chunked_context": True,
            "max_num_tokens": 16,
        },
        "kv_cache": {"max_tokens": 12 * BLOCK, "enable_block_reuse": True},
    },
}


def workload(vocab: int) -> list[tuple[list[int], int]]:
    """Eight prompts of 5-40 tokens, five of them starting with the same three blocks, 6-16 new tokens."""
    g = torch.Generator().manual_seed(30)
    shared = torch.randint(3, vocab, (3 * BLOCK,), generator=g).tolist()
    specs = []
    for i in range(8):
        own = torch.randint(3, vocab, (int(torch.randint(5, 17, (1,), generator=g)),), generator=g).tolist()
        specs.append(
            ((shared + own) if i % 2 == 0 or i == 7 else own, int(torch.randint(6, 17, (1,), generator=g)))
        )
    return specs


def run(model, specs, sections, ids) -> dict:
    requests = [
        InferenceRequest.from_values(
            i, specs[i][0], specs[i][1], return_log_probs=True, return_generation_logits=True
        )
        for i in ids
    ]
    client = StaggeredClient(requests, per_iteration=3)
    config = make_config(**sections)  # 8-token blocks (BLOCK)
    with BatchManager(config, client.get_requests, client.send_response, model=model) as manager:
        client.wait_or_fail()
        assert manager.runner.backend.native_decode is not None
        assert manager.runner.backend.native_decode.isa == kernel_isa("paged_decode")
    for rid, result in client.results.items():
        assert result.ok, (rid, result.error)
    return client.results


@pytest.fixture(scope="module")
def models():
    """The tiny model loaded under each build (its packed linears and fused chains take that build)."""
    loaded = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_SWITCH, "1")
        for isa in ISAS:
            mp.setenv(ENV_ISA, isa if isa != "native" else "auto")
            loaded[isa] = load_model(ModelConfig(device="cpu", seed=0))
    return loaded


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("isa", ISAS)
def test_log_probs_alone_and_in_a_batch_are_bitwise_equal(models, monkeypatch, isa, scenario):
    monkeypatch.setenv(ENV_SWITCH, "1")
    monkeypatch.setenv(ENV_ISA, isa if isa != "native" else "auto")
    model = models[isa]
    sections = SCENARIOS[scenario]
    specs = workload(model.vocab_size)
    together = run(model, specs, sections, range(len(specs)))
    if "max_tokens" in sections.get("kv_cache", {}):
        assert sum(r.num_pauses for r in together.values()) > 0, "the scenario must pause requests"
    if sections.get("kv_cache", {}).get("enable_block_reuse"):
        assert sum(r.num_reused_blocks for r in together.values()) > 0, "the scenario must reuse blocks"
    for i in range(len(specs)):
        alone = run(model, specs, sections, [i])[i]
        both = together[i]
        assert alone.output_ids == both.output_ids, f"request {i}"
        assert len(alone.output_log_probs) == specs[i][1]
        # exact float equality, step by step: not a tolerance
        assert alone.output_log_probs == both.output_log_probs, f"request {i}"
        assert torch.equal(alone.generation_logits, both.generation_logits), f"request {i}"

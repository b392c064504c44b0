"""Every entry of the model matrix (tests/model_matrix.py) matches HF generate() or is refused by name,
and the table in docs/models.md is the one the matrix renders."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bm.batch_manager import BatchManager, InferenceRequest
from bm.runtime import ModelRunner, UnsupportedAttentionError, work_item
from bm.runtime.attention import ATTENTION_NAME
from bm.runtime.model_loader import describe_model
from tests.clients import StaggeredClient
from tests.conftest import hf_greedy, make_config, random_prompts, reference_model
from tests.model_matrix import MATRIX, MODELS_DOC, Entry, doc_table, render_table
from tests.op_counts import HOST_READS, Operators


def build(entry: Entry) -> torch.nn.Module:
    kwargs = {k: v for k, v in entry.hf_config().items() if v is not None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(entry.model_type, **kwargs)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("entry", MATRIX, ids=[e.name for e in MATRIX])
def test_architecture_matches_hf_generate_or_is_refused_by_feature(entry: Entry):
    """Mixed prompt lengths, requests joining mid-generation, prompts chunked over iterations: each
    request's greedy output equals HF generate() on it alone."""
    model = build(entry)
    if entry.refused:
        with pytest.raises(UnsupportedAttentionError, match=entry.refused):
            describe_model(model, None, entry.name)
        return
    loaded = describe_model(model, None, entry.name)
    ref = reference_model(loaded)
    specs = random_prompts(seed=3, count=6, vocab=300, max_prompt=28, max_output=8)
    requests = [InferenceRequest.from_values(i, p, m) for i, (p, m) in enumerate(specs)]
    client = StaggeredClient(requests, per_iteration=2)
    config = make_config(
        engine={"max_batch_size": 4, "max_num_tokens": 16, "enable_chunked_context": True},
        kv_cache={"tokens_per_block": 4},
    )
    with BatchManager(config, client.get_requests, client.send_response, model=loaded, check_integrity=True):
        assert client.wait(120)
    for i, (prompt, max_new) in enumerate(specs):
        assert client.results[i].error == "", f"{entry.name} request {i}"
        assert client.results[i].output_ids == hf_greedy(ref, prompt, max_new), f"{entry.name} request {i}"


def test_matrix_has_25_architectures_and_few_refusals():
    types = {e.model_type for e in MATRIX}
    matched = {e.model_type for e in MATRIX if not e.refused}
    assert len(types) >= 25 and len(matched) >= 23


def test_models_doc_table_is_the_one_the_matrix_renders():
    table = doc_table(MODELS_DOC.read_text())
    assert table is not None, "docs/models.md lost its model matrix markers"
    assert table == render_table(), (
        "docs/models.md's model matrix is stale: run `python -m tests.model_matrix --write`"
    )


MATCHED = [e for e in MATRIX if not e.refused]


@pytest.mark.parametrize("entry", MATCHED, ids=[e.name for e in MATCHED])
def test_an_eager_forward_reads_no_device_value_on_the_host(entry: Entry):
    """A prompt beside decode rows, as bm's runner runs it eagerly, with no operator that syncs.

    transformers' mask preparation once ran its packed-sequence check here (``.all()`` on bm's
    position ids), because bm registered a no-op mask function under its attention's name: on CUDA
    every prompt step then waited for the step in flight, and overlap scheduling hid nothing there."""
    loaded = describe_model(build(entry), None, entry.name)
    if loaded.model.config._attn_implementation != ATTENTION_NAME:
        # adapted (bm.runtime.model_families: bloom, mpt, falcon; gptj and codegen before transformers 5.24):
        # its config cannot name bm's attention, so transformers' own mask code still runs (a dense mask, and
        # on Falcon the packed-sequence check). Old families, not what runs on a GPU: left as they are.
        pytest.skip(f"{entry.name}'s attention is adapted, and keeps transformers' mask code")
    runner = ModelRunner(loaded, num_blocks=16, tokens_per_block=4, max_seq_len=64)
    items = [work_item([5] * 7, 0, [0, 1]), work_item([6], 9, [2, 3, 4]), work_item([7], 13, [5, 6, 7, 8])]
    runner.forward(items)  # a first forward: whatever is set up once stays out of the count
    operators: Counter = Counter()
    with Operators(operators):
        runner.forward(items)
    assert [name for name in operators if name in HOST_READS] == []

"""LoRA through a PEFT cache: adapters saved by ``peft`` are the reference.

Oracle: each request's greedy output equals HF ``generate()`` on that request alone, on a ``PeftModel``
holding its adapter (or on the base model), while bm runs adapters and base requests mixed in one engine
and in the same packed forwards. The cache's bookkeeping (LRU eviction, waiting requests) is checked on
the fake executor, where every decision is visible without a model.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json

import pytest
import torch

from bm.batch_manager import InferenceRequest, generate
from bm.engine.execution.fake_executor import FakeExecutor
from bm.engine.requests.model_inputs import LORA_MODULE_NAMES, LoraSpec
from bm.engine.requests.request import Request
from bm.engine.step.core import EngineCore
from bm.runtime import lora as lora_module
from bm.runtime.lora import LoraLayers
from bm.runtime.lora_adapters import find_lora_targets, read_peft_adapter, task_id_for_directory
from bm.runtime.native import lora_delta_kernel
from tests.clients import StaggeredClient
from tests.conftest import hf_greedy, make_config, random_prompts

peft = pytest.importorskip("peft")

TARGETS = [
    ["q_proj", "v_proj"],
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ["o_proj", "down_proj"],
]


@pytest.fixture(scope="module")
def adapters(tiny_reference, tmp_path_factory):
    """Three peft adapters of different ranks and targets, saved; (directory, PeftModel) each."""
    out = []
    for i, targets in enumerate(TARGETS):
        torch.manual_seed(100 + i)
        config = peft.LoraConfig(
            r=[4, 8, 2][i], lora_alpha=[8, 4, 2][i], target_modules=targets, init_lora_weights=False
        )
        model = peft.get_peft_model(copy.deepcopy(tiny_reference), config)
        path = tmp_path_factory.mktemp(f"adapter{i}")
        model.save_pretrained(path)
        model.eval()
        out.append((path, model))
    return out


def lora_fields(path, with_weights: bool = True) -> dict:
    fields = {"lora_task_id": task_id_for_directory(path)}
    if with_weights:
        config, weights = read_peft_adapter(path)
        fields |= {"lora_config": torch.tensor(config, dtype=torch.int32), "lora_weights": weights}
    return fields


@pytest.mark.parametrize(("max_adapters", "path"), [(8, "kernel"), (2, "kernel"), (8, "torch")])
def test_three_peft_adapters_and_base_requests_mixed_in_one_engine_match_peft_generate(
    tiny_model, tiny_reference, adapters, max_adapters, path, monkeypatch
):
    """With 2 slots for 3 adapters, adapters are evicted and requests wait for a slot: every request
    then carries its weights (an evicted task named alone is refused, as the seed says). ``torch``: the
    torch paths that serve where the compiled kernel cannot be built."""
    if path == "torch":
        monkeypatch.setattr(lora_module, "lora_delta_kernel", lambda: None)
    vocab = tiny_model.vocab_size
    specs = random_prompts(seed=21, count=12, vocab=vocab, max_prompt=30, max_output=16)
    requests, expected = [], {}
    for i, (prompt, max_new) in enumerate(specs):
        which = i % 4  # 0..2: an adapter, 3: the base model
        if which == 3:
            requests.append(InferenceRequest.from_values(i, prompt, max_new))
            expected[i] = hf_greedy(tiny_reference, prompt, max_new)
            continue
        path, model = adapters[which]
        # only a task's first request carries the weights; later ones name the cached task
        carry = i < 3 or max_adapters < len(adapters)
        requests.append(InferenceRequest.from_values(i, prompt, max_new, **lora_fields(path, carry)))
        expected[i] = hf_greedy(model, prompt, max_new)
    base = [hf_greedy(tiny_reference, p, m) for p, m in specs]
    assert sum(expected[i] != base[i] for i in expected if i % 4 != 3) >= 6  # the adapters do change outputs

    stats: list[str] = []
    client = StaggeredClient(requests, per_iteration=3)
    from bm.batch_manager import BatchManager

    config = make_config(
        engine={"max_batch_size": 8, "max_num_tokens": 128}, peft_cache={"max_adapters": max_adapters}
    )
    with BatchManager(
        config,
        client.get_requests,
        client.send_response,
        model=tiny_model,
        return_stats=stats.append,
        check_integrity=True,
    ):
        assert client.wait(120)
    for i, tokens in expected.items():
        assert client.results[i].ok, client.results[i].error
        assert client.results[i].output_ids == tokens, f"request {i}"
    last = json.loads(stats[-1])
    if max_adapters >= len(adapters):
        assert last["PEFT Loaded Adapters"] == 3 and last["PEFT Loads"] == 3 and last["PEFT Evictions"] == 0
    else:
        assert last["PEFT Evictions"] > 0
        assert max(json.loads(s)["PEFT Waiting Requests"] for s in stats) > 0
    # mixed forwards: some iteration computed tokens of several adapters and the base model together
    assert max(json.loads(s)["Scheduled Requests"] for s in stats) >= 4


def test_a_task_id_that_is_not_cached_is_refused_naming_it(tiny_model, adapters):
    path, _ = adapters[0]
    task = task_id_for_directory(path)
    results = generate(
        [InferenceRequest.from_values(0, [5, 6, 7], 3, lora_task_id=task)], make_config(), model=tiny_model
    )
    assert f"lora_task_id: task {task} is not in the PEFT cache" in results[0].error


def test_a_module_the_model_lacks_and_a_short_weight_row_are_refused_by_name(tiny_model):
    qkv = InferenceRequest.from_values(
        0, [5, 6], 3, lora_task_id=1, lora_config=torch.tensor([[0, 0, 2]]), lora_weights=torch.zeros(1, 512)
    )
    short = InferenceRequest.from_values(
        1, [5, 6], 3, lora_task_id=2, lora_config=torch.tensor([[1, 0, 2]]), lora_weights=torch.zeros(1, 5)
    )
    layer = InferenceRequest.from_values(
        2, [5, 6], 3, lora_task_id=3, lora_config=torch.tensor([[1, 99, 2]]), lora_weights=torch.zeros(1, 512)
    )
    results = generate([qkv, short, layer], make_config(), model=tiny_model)
    assert (
        "lora_config: row 0 targets attn_qkv (module id 0) of layer 0, which this model lacks"
        in results[0].error
    )
    assert "lora_weights: row 0 (attn_q, layer 0, adapter_size 2) has 5 values" in results[1].error
    assert "targets attn_q (module id 1) of layer 99" in results[2].error


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"lora_config": [[1, 0, 2]], "lora_weights": [[0.0] * 4]}, "lora_task_id: missing"),
        ({"lora_task_id": 1, "lora_config": [[1, 0, 2]]}, "lora_weights: missing"),
        ({"lora_task_id": 1, "lora_config": [[9, 0, 2]], "lora_weights": [[0.0]]}, "module id 9; supported"),
        (
            {"lora_task_id": 1, "lora_config": [[1, 0, 2], [1, 0, 2]], "lora_weights": [[0.0], [0.0]]},
            "repeats",
        ),
        ({"lora_task_id": 1, "lora_config": [[1, 0, 2]], "lora_weights": [[0.0], [0.0]]}, "2 rows but"),
    ],
)
def test_inconsistent_lora_fields_are_refused_naming_the_field(fields, message):
    core = EngineCore(make_config(), FakeExecutor())
    response = core.add_request(Request(0, [5, 6], 3, **fields))
    assert response is not None and message in response.error


def fake_lora(task: int, weights: bool = True) -> dict:
    if not weights:
        return {"lora_task_id": task}
    return {"lora_task_id": task, "lora_config": [[1, 0, 1]], "lora_weights": [[0.5] * 8]}


def run_until_done(core: EngineCore, max_steps: int = 200):
    finals, waiting_seen = {}, []
    for _ in range(max_steps):
        if not core.num_active:
            break
        out = core.step()
        waiting_seen.append(out.stats.peft.waiting_requests if out.stats else 0)
        for r in out.responses:
            if r.final:
                finals[r.request_id] = r
    return finals, waiting_seen


def test_lru_eviction_frees_an_unheld_adapter_and_a_request_waits_while_all_are_held():
    executor = FakeExecutor()
    core = EngineCore(make_config(peft_cache={"max_adapters": 2}, kv_cache={"max_tokens": 4096}), executor)
    # tasks 1 and 2 fill the cache; 1 finishes first (short), so it is the unheld one when 3 arrives
    assert core.add_request(Request(0, [5, 6], 2, **fake_lora(1))) is None
    assert core.add_request(Request(1, [5, 6], 30, **fake_lora(2))) is None
    core.step()
    assert executor.adapter_loads == [(0, 1), (1, 2)]
    finals, _ = run_until_done(core, max_steps=3)
    assert 0 in finals and core.peft_cache.loaded_tasks() == [1, 2]
    # 3 evicts 1 (least recently used, unheld); 4 then finds 2 and 3 both held and waits
    assert core.add_request(Request(2, [5, 6], 30, **fake_lora(3))) is None
    assert core.add_request(Request(3, [7, 8], 4, **fake_lora(4))) is None
    out = core.step()
    assert executor.adapter_loads[-1] == (0, 3)
    assert out.stats.peft.evictions == 1 and out.stats.peft.waiting_requests == 1
    assert 3 not in out.schedule.context_ids
    # task 1 was evicted: naming it alone is now an error
    refused = core.add_request(Request(4, [5], 2, **fake_lora(1, weights=False)))
    assert refused is not None and "task 1 is not in the PEFT cache" in refused.error
    finals, waiting = run_until_done(core)
    assert sorted(finals) == [1, 2, 3] and all(not r.error for r in finals.values())
    assert finals[3].output_ids and max(waiting) == 1  # it waited, then ran; never failed
    assert executor.adapter_loads[-1][1] == 4 and core.peft_cache.counts.evictions == 2


def test_max_bytes_bounds_the_loaded_adapters_and_an_adapter_too_large_is_refused():
    config = make_config(peft_cache={"max_adapters": 4, "max_bytes": 64}, kv_cache={"max_tokens": 4096})
    core = EngineCore(config, FakeExecutor())  # 4 bytes a value: one adapter of 8 values is 32 bytes
    big = {"lora_task_id": 9, "lora_config": [[1, 0, 1]], "lora_weights": [[0.5] * 20]}
    refused = core.add_request(Request(0, [5, 6], 2, **big))
    assert refused is not None and "more than peft_cache.max_bytes (64)" in refused.error
    for i, task in enumerate((1, 2, 3)):
        assert core.add_request(Request(10 + i, [5, 6], 3, **fake_lora(task))) is None
    out = core.step()
    assert out.stats.peft.loaded == 2 and out.stats.peft.loaded_bytes == 64
    finals, _ = run_until_done(core)
    assert sorted(finals) == [10, 11, 12] and all(not r.error for r in finals.values())


def test_jsonl_lora_dir_becomes_the_seed_form_with_a_task_id_from_the_directory(tmp_path, adapters):
    from bm.runfiles.prompts import read_prompt_lines

    path, _ = adapters[1]
    lines = tmp_path / "prompts.jsonl"
    lines.write_text(
        json.dumps({"input_ids": [5, 6], "lora_dir": str(path)})
        + "\n"
        + json.dumps({"input_ids": [5, 6], "lora_dir": str(path), "lora_task_id": 77})
        + "\n"
        + json.dumps({"input_ids": [5, 6], "lora_dir": str(tmp_path / "missing")})
        + "\n"
    )
    (first, first_request), (_, second_request), (bad, bad_request) = read_prompt_lines(lines, None, 8, None)
    assert first.error is None and first_request.lora_task_id == task_id_for_directory(path)
    config, weights = read_peft_adapter(path)
    assert first_request.lora_config == config and torch.equal(first_request.lora_weights, weights)
    assert second_request.lora_task_id == 77
    assert (
        bad_request is None
        and bad.error is not None
        and "line 3: lora_dir" in bad.error
        and "adapter_config.json is missing" in bad.error
    )


def seed_form_adapter(model, modules: dict[str, int], seed: int) -> tuple[LoraSpec, dict]:
    """A random adapter in the seed's form on ``modules`` (name -> rank) of every layer, and its
    ``(A, B)`` per (module id, layer) for the reference computation."""
    g = torch.Generator().manual_seed(seed)
    rows, weights, pairs = [], [], {}
    for (module, layer), linear in sorted(find_lora_targets(model).items()):
        rank = modules.get(LORA_MODULE_NAMES[module])
        if rank is None:
            continue
        a = torch.randn(rank, linear.in_features, generator=g) * 0.1
        b = torch.randn(linear.out_features, rank, generator=g) * 0.1
        rows.append((module, layer, rank))
        weights.append(torch.cat([a.flatten(), b.flatten()]))
        pairs[(module, layer)] = (a, b)
    width = max(len(w) for w in weights)
    padded = torch.stack([torch.nn.functional.pad(w, (0, width - len(w))) for w in weights])
    return LoraSpec(task_id=seed, config=tuple(rows), weights=padded), pairs


@pytest.mark.parametrize("path", ["segmented", "masked", "kernel"])
def test_each_token_meets_only_its_own_adapter_and_base_tokens_are_left_bit_exact(
    tiny_model, monkeypatch, path
):
    """Every path: items of one slot are one row range (one GEMM each, or one masked GEMM for all, or
    one compiled-kernel call per layer); q/k/v (and gate/up) share one x @ A on the torch paths; a slot
    reloaded with an adapter on fewer modules keeps nothing of the old one."""
    monkeypatch.setattr(lora_module, "MASKED_PATH_ROWS", 0 if path == "segmented" else 10**6)
    if path == "kernel":
        if lora_delta_kernel() is None:
            pytest.skip("no C compiler here: the LoRA kernel cannot be built")
    else:
        monkeypatch.setattr(lora_module, "lora_delta_kernel", lambda: None)
    model = copy.deepcopy(tiny_model.model)
    own = {key: t.__dict__.get("forward") for key, t in find_lora_targets(model).items()}
    layers = LoraLayers(model, torch.float32, torch.device("cpu"))
    everything = dict.fromkeys(["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate"], 4)
    stale, _ = seed_form_adapter(model, everything | {"mlp_4h_to_h": 4}, seed=1)
    adapters = [
        seed_form_adapter(model, {"attn_q": 2, "attn_v": 8, "mlp_4h_to_h": 3}, seed=2),
        seed_form_adapter(model, everything, seed=3),
        seed_form_adapter(model, {"mlp_gate": 1, "attn_dense": 5}, seed=4),
    ]
    layers.load(0, stale)
    for slot, (spec, _) in enumerate(adapters):
        layers.load(slot, spec)
    items = [(-1, 3), (0, 4), (0, 2), (1, 5), (2, 1), (2, 3)]  # base first, then slot by slot
    token_slots = [slot for slot, n in items for _ in range(n)]
    g = torch.Generator().manual_seed(0)
    inputs: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        layers.begin(items)
        assert bool(layers.masks) == (path == "masked")
        assert (layers.token_slots is not None) == (path == "kernel")
        for (module, layer), linear in sorted(find_lora_targets(model).items()):
            x = inputs.setdefault(
                linear.in_features, torch.randn(1, len(token_slots), linear.in_features, generator=g)
            )
            if LORA_MODULE_NAMES[module] == "attn_k":
                x = x.clone()  # a member of a shared-input group seeing another tensor recomputes x @ A
            base = torch.nn.functional.linear(x, linear.weight, linear.bias)[0]
            out = linear(x)[0]
            for t, slot in enumerate(token_slots):
                pair = adapters[slot][1].get((module, layer)) if slot >= 0 else None
                if pair is None:
                    assert torch.equal(out[t], base[t]), (LORA_MODULE_NAMES[module], layer, t)
                else:
                    a, b = pair
                    torch.testing.assert_close(out[t], base[t] + (x[0, t] @ a.T) @ b.T)
        layers.end()
        linear = find_lora_targets(model)[(1, 0)]
        x = inputs[linear.in_features]
        assert torch.equal(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    layers.close()
    assert all(t.__dict__.get("forward") is own[key] for key, t in find_lora_targets(model).items())


def test_an_engine_that_goes_away_gives_the_shared_model_its_layers_back(tiny_model):
    """Engines come and go on one loaded model (tests, benchmarks): adapters must not leave a wrapper
    behind that later base-model runs would pay for."""
    model = copy.deepcopy(tiny_model.model)
    own = {key: t.__dict__.get("forward") for key, t in find_lora_targets(model).items()}
    for _ in range(2):
        layers = LoraLayers(model, torch.float32, torch.device("cpu"))
        layers.load(0, seed_form_adapter(model, {"attn_q": 2, "mlp_gate": 2}, seed=5)[0])
        assert sum(t.__dict__.get("forward") is not own[k] for k, t in find_lora_targets(model).items()) > 0
        del layers
        gc.collect()
        assert all(t.__dict__.get("forward") is own[k] for k, t in find_lora_targets(model).items())


@pytest.mark.parametrize("form", ["tensor", "lists"])
def test_a_non_finite_weight_is_refused_naming_its_row_and_padding_after_a_row_is_never_read(
    tiny_model, form
):
    targets = find_lora_targets(tiny_model.model)
    q = targets[(1, 0)]  # attn_q of layer 0, the widest row below (rank 2)
    width = 2 * (q.in_features + q.out_features)
    weights = torch.full((2, width + 3), 0.01)
    weights[0, width:] = float("nan")  # row 0's padding: never read
    weights[1, 5] = float("inf")
    config = torch.tensor([[1, 0, 2], [3, 0, 2]])
    given = weights if form == "tensor" else weights.tolist()
    request = InferenceRequest.from_values(
        0, [5, 6], 2, lora_task_id=7, lora_config=config, lora_weights=given
    )
    results = generate([request], make_config(), model=tiny_model)
    assert "lora_weights: row 1 holds a non-finite value" in results[0].error


def test_an_engine_without_adapters_after_one_with_them_shares_the_model_and_matches_hf(
    tiny_model, tiny_reference, adapters
):
    """Engines over one loaded model take its executor in turn (bm.runtime.executor.executor_for): the
    first engine's adapter slots go with it. Left behind, they failed the next engine's first step
    ('NoneType' object has no attribute 'begin') when a test file without adapters followed one with
    them in the same process."""
    model = dataclasses.replace(tiny_model)  # an executor of this test's own
    path, peft_model = adapters[0]
    prompt = [5, 6, 7, 8]
    adapted = generate(
        [InferenceRequest.from_values(0, prompt, 4, **lora_fields(path))], make_config(), model=model
    )
    assert adapted[0].output_ids == hf_greedy(peft_model, prompt, 4)
    base = generate([InferenceRequest.from_values(0, prompt, 4)], make_config(), model=model)
    assert not base[0].error
    assert base[0].output_ids == hf_greedy(tiny_reference, prompt, 4)

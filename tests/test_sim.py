"""The simulator: its cost model, its refusals, its cost fields, and that it schedules exactly as the
real engine does (the property that makes its what-ifs worth anything)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bm.bench.simulated import cost_metrics
from bm.config import ConfigError, load_config
from bm.engine.execution.protocol import ExecutionBatch, WorkItem, WorkKind
from bm.engine.requests.request import Request
from bm.engine.step.core import EngineCore
from bm.scheduling.request import LlmRequest
from bm.sim import CostModel, Hardware, ModelShape, SimExecutor, hardware_table, load_hardware
from bm.sim.cost import IterationCost

from .conftest import REPO, make_config

TINY = {
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 16,
    "vocab_size": 32,
}


def unit_hardware(**overrides) -> Hardware:
    """1 FLOP/s and 1 byte/s, no derating, no overheads: a time is then a count of FLOPs or bytes."""
    row = dict(
        key="unit",
        name="unit",
        flops={"float32": 1.0},
        memory_bw=1.0,
        memory=1e12,
        interconnect_bw=2.0,
        price_per_hour=3.6,
        source="test",
        compute_efficiency=1.0,
        memory_efficiency=1.0,
        iteration_overhead_s=0.0,
        layer_overhead_s=0.0,
        allreduce_latency_s=0.0,
    )
    return Hardware(**(row | overrides))


def request(rid: int, prompt: int, output: int = 4) -> LlmRequest:
    return LlmRequest(rid, list(range(3, 3 + prompt)), output)


def item(req: LlmRequest, kind: WorkKind, n: int, start: int, sample: bool = True) -> WorkItem:
    return WorkItem(req, kind, [5] * n, start, [0] * 64, sample)


def test_cost_model_counts_flops_and_bytes_of_a_tiny_config_by_hand():
    shape = ModelShape.from_dict(TINY)
    # per layer: q 8x8, o 8x8, k 8x4, v 8x4 (head_dim 4, one kv head) = 192; MLP 3x8x16 = 384
    assert shape.layer_linear_params == 192 + 384
    assert shape.kv_bytes_per_token(4) == 2 * 2 * 1 * 4 * 4  # K and V, 2 layers, 1 head of 4, fp32
    cm = CostModel(shape, unit_hardware(), "float32")
    # a 3-token prompt from position 0, and one decode token at position 5
    prompt, decode = request(0, 3), request(1, 5)
    forward = [item(prompt, WorkKind.CONTEXT, 3, 0), item(decode, WorkKind.GENERATION, 1, 5)]
    cost = cm.forward_cost(forward)
    assert cost.tokens == 4 and cost.logit_rows == 2
    assert cost.linear_flops == 2 * 4 * (2 * 576) + 2 * 2 * (8 * 32)
    # activations: (4h + 2i) per token per layer, read or written once
    assert cost.linear_bytes == (2 * 576 + 8 * 32) * 4 + 4 * (4 * 8 + 2 * 16) * 2 * 4
    # (query, key) pairs: the prompt 1 + 2 + 3, the decode token 6; 4 * heads * head_dim * layers each
    assert cost.attention_flops == 4 * 2 * 4 * 2 * (6 + 6)
    assert cost.kv_read_bytes == (3 + 6) * 64 and cost.kv_write_bytes == 4 * 64
    seconds = cm.iteration(ExecutionBatch([forward])).seconds
    expected = (
        max(cost.linear_flops, cost.linear_bytes)
        + max(cost.attention_flops, cost.kv_read_bytes)
        + cost.kv_write_bytes
    )
    assert seconds == pytest.approx(expected)


@pytest.mark.parametrize(
    ("setting", "device", "overlapped"),
    [("auto", "cuda", True), ("auto", "cpu", False), ("off", "cuda", False), ("on", "cpu", True)],
)
def test_an_iteration_costs_host_plus_device_in_order_and_the_longer_of_the_two_overlapped(
    setting, device, overlapped
):
    """engine.overlap_scheduler resolves for a row's device as the engine resolves it (auto: on for a
    GPU); overlapped, the host's per-iteration time hides behind the forward, in order it adds. The
    fast-forward's decode price follows the same rule (its rows must equal the step-by-step ones)."""
    from bm.bench.simulated import sim_overlaps

    shape = ModelShape.from_dict(TINY)
    overlap = sim_overlaps(make_config(engine={"overlap_scheduler": setting}), device)
    assert overlap is overlapped
    forward = [item(request(0, 3), WorkKind.CONTEXT, 3, 0)]
    for host in (1.0, 1e6):  # shorter than the forward, then longer
        cm = CostModel(shape, unit_hardware(iteration_overhead_s=host), "float32", overlap=overlap)
        device_s = cm.time_forward(cm.forward_cost(forward), IterationCost())
        seconds = cm.iteration(ExecutionBatch([forward])).seconds
        assert seconds == pytest.approx(max(device_s, host) if overlapped else device_s + host)
        decode = CostModel(shape, unit_hardware(iteration_overhead_s=host), "float32", overlap=overlap)
        step = [item(request(1, 6), WorkKind.GENERATION, 1, 6)]
        assert decode.decode_seconds(1, 6) == pytest.approx(decode.iteration(ExecutionBatch([step])).seconds)
    assert not sim_overlaps(make_config(engine={"batching_scheme": "v1"}), "cuda")  # V1 never overlaps


def test_tensor_parallel_divides_the_work_and_adds_two_all_reduces_per_layer():
    shape = ModelShape.from_dict(TINY)
    one = CostModel(shape, unit_hardware(), "float32", 1)
    two = CostModel(shape, unit_hardware(), "float32", 2)
    forward = [item(request(0, 4), WorkKind.CONTEXT, 4, 0)]
    c1, c2 = one.forward_cost(forward), two.forward_cost(forward)
    # ring all-reduce of 4 tokens x 8 hidden x 4 bytes, 2 per layer, 2 layers, 2 (tp-1)/tp = 1
    assert c1.allreduce_bytes == 0 and c2.allreduce_bytes == 2 * 2 * (4 * 8 * 4) * 1
    t1 = one.iteration(ExecutionBatch([forward])).seconds
    t2 = two.iteration(ExecutionBatch([forward])).seconds
    assert t2 == pytest.approx(t1 / 2 + c2.allreduce_bytes / 1.0)  # half of the 2 B/s link per direction


def test_kv_capacity_is_memory_minus_weights_times_the_free_fraction():
    shape = ModelShape.from_dict(TINY)
    hw = unit_hardware(memory=shape.num_params * 4 + 64 * 1000)  # room for 1000 tokens of KV
    executor = SimExecutor(CostModel(shape, hw, "float32"))
    config = make_config(kv_cache={"max_tokens": None, "free_memory_fraction": 0.5, "tokens_per_block": 10})
    assert executor.num_kv_blocks(config.kv_cache, 10**9) == 50
    assert executor.kv_capacity_tokens == 500


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"stop_words_list": [[7, 8]]}, "stop_words_list"),
        ({"return_log_probs": True}, "return_log_probs"),
        ({"return_generation_logits": True}, "return_generation_logits"),
        ({"beam_width": 2}, "beam_width"),
    ],
)
def test_requests_needing_real_logits_are_refused_naming_the_field(fields, named):
    shape = ModelShape.from_dict(TINY)
    core = EngineCore(
        make_config(engine={"max_beam_width": 2}), SimExecutor(CostModel(shape, unit_hardware(), "float32"))
    )
    refused = core.add_request(Request(0, [3, 4, 5], 4, **fields))
    assert refused is not None and refused.final
    assert f"field {named!r} needs real logits" in refused.error
    assert "--executor sim" in refused.error


def test_cost_is_price_times_devices_times_simulated_hours_per_million_tokens():
    hw = unit_hardware(price_per_hour=2.0)
    out = cost_metrics(hw, 4, 1800.0, output_tokens=500_000, total_tokens=2_000_000)
    assert out["cost_usd"] == pytest.approx(4.0)  # 2 $/h x 4 devices x 0.5 h
    assert out["cost_per_million_output_tokens"] == pytest.approx(8.0)
    assert out["cost_per_million_total_tokens"] == pytest.approx(2.0)
    assert cost_metrics(hw, 1, 10.0, 0, 0)["cost_per_million_output_tokens"] is None


def test_every_shipped_hardware_row_has_its_figures_and_a_datasheet_source():
    table = hardware_table()
    assert set(table) == {"h100-sxm", "h200", "b200", "a100-80gb", "l40s", "mi300x"}
    for row in table.values():
        assert row.peak_flops("bfloat16") > 1e14 and row.memory_bw > 1e11 and row.memory > 1e10
        assert row.source.startswith("https://") and row.price_per_hour > 0
    with pytest.raises(ConfigError, match="--hardware 'h300': unknown; allowed: h100-sxm"):
        load_hardware("h300")


def test_the_sim_package_imports_without_torch():
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'): raise ImportError('no torch here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import bm.sim, bm.bench.simulated\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# -- whole runs ---------------------------------------------------------------------------------------


def sim_config(tmp_path: Path, **sets) -> object:
    model_config = tmp_path / "tiny.json"
    model_config.write_text(json.dumps(TINY | {"vocab_size": 512, "max_position_embeddings": 4096}))
    overrides = {
        "engine.executor": "sim",
        "sim.hardware": "a100-80gb",
        "model.config": str(model_config),
        "bench.dataset_kind": "synthetic",
        "bench.num_requests": 40,
        "bench.input_len": 64,
        "bench.output_len": 24,
        "bench.range_ratio": 0.5,
        "bench.request_rate": 50.0,
        "bench.seed": 3,
        "engine.max_batch_size": 8,
    }
    return load_config(None, overrides | sets)


def run_document(config) -> dict:
    from bm.bench import results_document, run_bench
    from bm.bench.simulated import load_sim_model
    from bm.workloads import load_workload

    model = load_sim_model(config)
    workload = load_workload(config.bench, vocab_size=model.vocab_size, encode=None)
    return results_document(run_bench(config, model, workload))


def test_two_simulated_runs_with_the_same_seed_write_the_same_results(tmp_path):
    wall_clock = ("date", "wall_time_s", "startup")  # start-up is wall time too
    first, second = (run_document(sim_config(tmp_path)) for _ in range(2))
    assert first["completed"] == 40 and first["num_iterations"] > 40
    assert {k: v for k, v in first.items() if k not in wall_clock} == {
        k: v for k, v in second.items() if k not in wall_clock
    }


def test_a_simulated_run_is_marked_sim_with_its_hardware_row_and_its_cost(tmp_path):
    doc = run_document(sim_config(tmp_path, **{"sim.tensor_parallel": 2}))
    assert doc["executor"] == "sim"
    assert doc["runtime"]["hardware"]["key"] == "a100-80gb"
    assert doc["runtime"]["num_devices"] == 2
    assert doc["config"]["engine"]["executor"] == "sim"
    hours = doc["duration"] / 3600
    dollars = doc["runtime"]["hardware"]["price_per_hour"] * 2 * hours
    assert doc["cost_per_million_output_tokens"] == pytest.approx(dollars / doc["total_output_tokens"] * 1e6)
    total = doc["total_output_tokens"] + doc["total_input_tokens"]
    assert doc["cost_per_million_total_tokens"] == pytest.approx(dollars / total * 1e6)
    # simulated time: every iteration takes the cost model's time, so latencies are positive and finite
    assert doc["median_ttft_ms"] > 0 and doc["mean_itl_ms"] > 0


@pytest.mark.parametrize("row", ["h100-sxm", "h200", "b200", "a100-80gb", "l40s", "mi300x"])
@pytest.mark.parametrize("dtype", ["auto", "float32", "bf16", "float16"])
def test_sim_and_real_engine_resolve_auto_dtype_alike(tmp_path, row, dtype):
    """A GPU row is simulated in the dtype bm's engine would load on a GPU (auto: bfloat16; float32 stays
    float32, run in TF32), whatever torch_dtype the model config names; results.json records it."""
    import torch

    from bm.bench.simulated import load_sim_model
    from bm.runtime.model_loader import resolve_dtype

    config_file = tmp_path / "tiny.json"
    config_file.write_text(json.dumps(TINY | {"torch_dtype": "float32"}))  # no say in the dtype
    sets = {
        "engine.executor": "sim",
        "sim.hardware": row,
        "model.config": str(config_file),
        "model.dtype": dtype,
    }
    config = load_config(None, sets)
    precision = torch.get_float32_matmul_precision()
    try:
        real = str(resolve_dtype(config.model.dtype, torch.device("cuda"))).removeprefix("torch.")
    finally:
        torch.set_float32_matmul_precision(precision)  # resolve_dtype sets TF32 for float32 on CUDA
    model = load_sim_model(config)
    assert model.dtype == real == {"auto": "bfloat16", "bf16": "bfloat16"}.get(dtype, dtype)
    assert model.runtime()["dtype"] == real


def test_auto_dtype_is_float32_on_the_cpu_for_the_sim_and_the_real_engine():
    import torch

    from bm.config import resolve_dtype_name
    from bm.runtime.model_loader import resolve_dtype
    from bm.sim.hardware import LOCAL_ROWS

    assert resolve_dtype_name("auto", LOCAL_ROWS["cpu-local"]) == "float32"
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype_name("auto", LOCAL_ROWS["cuda-local"]) == "bfloat16"


@pytest.mark.parametrize(
    "engine",
    [
        {"batching_scheme": "inflight_fused", "scheduler_policy": "guaranteed_no_evict"},
        {"batching_scheme": "inflight", "scheduler_policy": "max_utilization"},
        {"batching_scheme": "v1", "scheduler_policy": "static_batch"},
        {"enable_chunked_context": True, "max_num_tokens": 64, "max_batch_size": 6},
    ],
)
def test_the_sim_schedules_every_iteration_exactly_as_the_torch_engine(tiny_model, engine):
    """Every request at t=0: scheduling does not depend on time, so the simulated run's schedule (ids,
    context/generation tokens, KV blocks) must equal the real one's, iteration by iteration."""
    from bm.runtime.executor import TorchExecutor

    config = make_config(engine={"max_batch_size": 4, **engine}, kv_cache={"max_tokens": 320})
    shape = ModelShape.from_dict(tiny_model.model.config.to_dict())
    requests = [Request(i, [3 + (i * 7 + j) % 200 for j in range(9 + 13 * i % 40)], 3 + 5 * i % 11)
                for i in range(10)]  # fmt: skip

    def trace(executor) -> list[tuple]:
        core = EngineCore(config, executor)
        for r in requests:
            assert core.add_request(r) is None
        rows = []
        while core.num_active:
            out = core.step()
            s, st = out.schedule, out.stats
            rows.append((s.context_ids, s.context_chunks, s.generation_ids, s.paused_ids, s.padding_ids,
                         s.empty_slot_ids, st.context_tokens, st.generation_tokens, st.used_blocks,
                         st.max_blocks, st.computed_tokens))  # fmt: skip
            assert len(rows) < 1000
        return rows

    real = trace(TorchExecutor(tiny_model))
    simulated = trace(SimExecutor(CostModel(shape, load_hardware("h100-sxm"), "float32")))
    assert len(real) > 5
    assert simulated == real


# -- the command line ---------------------------------------------------------------------------------


def test_bench_executor_sim_writes_the_three_files_and_prints_the_cost(tmp_path):
    from typer.testing import CliRunner

    from bm.cli.main import app

    model_config = tmp_path / "tiny.json"
    model_config.write_text(json.dumps(TINY | {"vocab_size": 512}))
    out = tmp_path / "out"
    args = ["bench", "--executor", "sim", "--hardware", "l40s", "--tensor-parallel", "2",
            "--model-config", str(model_config), "--dataset-kind", "synthetic", "-n", "12",
            "--input-len", "32", "--output-len", "8", "--rate", "20", "-o", str(out), "--quiet"]  # fmt: skip
    result = CliRunner().invoke(app, args, terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "Cost per million output tokens (USD)" in result.output and "l40s x 2" in result.output
    doc = json.loads((out / "results.json").read_text())
    assert doc["executor"] == "sim" and doc["completed"] == 12
    assert doc["cost_per_million_output_tokens"] > 0
    stats = [json.loads(line) for line in (out / "stats.jsonl").read_text().splitlines()]
    assert len(stats) == doc["num_iterations"]
    assert sum(json.loads(line)["output_tokens"] for line in (out / "requests.jsonl").open()) == 12 * 8


def test_bench_executor_sim_without_a_model_config_exits_2_naming_the_option(tmp_path):
    from typer.testing import CliRunner

    from bm.cli.main import app

    args = ["bench", "--executor", "sim", "--dataset-kind", "synthetic", "-n", "2", "--quiet"]
    result = CliRunner().invoke(app, args, terminal_width=200)
    assert result.exit_code == 2
    assert "--model-config" in result.output


def test_int8_weights_are_priced_a_byte_a_weight_and_a_scale_a_row_and_leave_more_room_for_kv():
    from bm.sim.model import INT8

    shape = ModelShape.from_dict(TINY)
    # one layer's linears as (outputs, inputs): q 8x8, k and v 4x8, o 8x8, gate and up 16x8, down 8x16
    assert shape.layer_linears() == [(8, 8), (4, 8), (4, 8), (8, 8), (16, 8), (16, 8), (8, 16)]
    full, int8 = (
        CostModel(shape, unit_hardware(), "float32"),
        CostModel(shape, unit_hardware(), "float32", weights=INT8),
    )
    decode = [item(request(1, 5), WorkKind.GENERATION, 1, 5)]
    saved = full.forward_cost(decode).linear_bytes - int8.forward_cost(decode).linear_bytes
    outputs = 8 + 4 + 4 + 8 + 16 + 16 + 8
    assert saved == 2 * (
        576 * 4 - (576 * 1 + outputs * 4)
    )  # two layers: float32 against a byte and a row scale
    assert (
        int8.forward_cost(decode).linear_flops == full.forward_cost(decode).linear_flops
    )  # the same products
    assert (
        full.weight_bytes_per_rank() - int8.weight_bytes_per_rank() == saved
    )  # head and embeddings stay full
    assert int8.iteration(ExecutionBatch([decode])).seconds < full.iteration(ExecutionBatch([decode])).seconds
    hw = unit_hardware(memory=shape.num_params * 4 + 64 * 1000)
    config = make_config(kv_cache={"max_tokens": None, "free_memory_fraction": 1.0, "tokens_per_block": 10})
    room = [
        SimExecutor(CostModel(shape, hw, "float32", weights=w)).num_kv_blocks(config.kv_cache, 10**9)
        for w in (full.weights, INT8)
    ]
    assert room[1] > room[0] == 100


@pytest.mark.parametrize(
    ("quant", "priced"),
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, ("gptq", 4, 128, 8)),
        ({"quant_method": "awq", "w_bit": 4, "q_group_size": 64}, ("awq", 4, 64, 8)),
        ({"quant_method": "gptq", "bits": 4, "group_size": -1}, ("gptq", 4, None, 8)),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, ("fp8", 8, 128, 8)),
        ({"quant_method": "fp8"}, ("fp8", 8, None, 8)),
    ],
)
def test_a_stored_checkpoints_config_is_priced_in_its_own_format_never_as_full_width(tmp_path, quant, priced):
    from bm.sim.model import WeightFormat, weight_format

    (tmp_path / "config.json").write_text(json.dumps(TINY | {"quantization_config": quant}))
    assert weight_format("auto", tmp_path) == WeightFormat(*priced)
    assert weight_format(priced[0], tmp_path / "config.json") == WeightFormat(*priced)
    with pytest.raises(
        ConfigError, match=rf"is a {priced[0]} checkpoint, which model.quantization: none .* auto"
    ):
        weight_format("none", tmp_path)


def test_weights_the_simulator_cannot_price_are_refused_naming_the_fix(tmp_path):
    from bm.sim.model import FP8_ROWS, FULL_WIDTH, INT8, WeightFormat, weight_format

    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(TINY))
    assert weight_format("auto", plain) == weight_format("none", plain) == FULL_WIDTH
    assert weight_format("int8", plain) == INT8
    # FP8 on load: a byte a weight and a scale a row, as a per-channel FP8 checkpoint is priced
    assert weight_format("fp8", plain) == FP8_ROWS == WeightFormat("fp8", 8, None, 8)
    with pytest.raises(
        ConfigError,
        match=r"model.quantization: gptq prices a gptq checkpoint's weights.*no quantization_config",
    ):
        weight_format("gptq", plain)
    for quant, named in (
        ({"quant_method": "bitsandbytes"}, "not 'bitsandbytes' ones"),
        ({"quant_method": "gptq", "bits": 8}, "a 8-bit gptq checkpoint; bm reads 4-bit ones"),
    ):
        (tmp_path / "config.json").write_text(json.dumps(TINY | {"quantization_config": quant}))
        with pytest.raises(ConfigError, match=named):
            weight_format("auto", tmp_path)
    with pytest.raises(
        ConfigError, match=r"the simulator prices a config\.json's shape, not a GGUF file's blocks"
    ):
        make_config(model={"quantization": "gguf", "path": str(tmp_path / "m.gguf")},
                    engine={"executor": "sim"}, bench={"ignore_eos": True})  # fmt: skip


def test_a_local_rows_fit_of_quantized_weights_is_kept_apart_from_the_full_width_one():
    from bm.sim.forward_fit import fit_key, model_key
    from bm.sim.model import INT8, WeightFormat

    shape = ModelShape.from_dict(TINY)
    assert (
        fit_key(shape, "float32")
        == fit_key(shape, "float32", WeightFormat())
        == model_key(shape.shape_dict(), "float32")
    )
    assert (
        len(
            {
                fit_key(shape, "float32"),
                fit_key(shape, "float32", INT8),
                fit_key(shape, "float32", WeightFormat("gptq", 4, 128, 8)),
            }
        )
        == 3
    )


def test_bench_executor_sim_prices_int8_weights_and_says_so(tmp_path):
    from bm.bench.simulated import load_sim_model

    model_config = tmp_path / "tiny.json"
    model_config.write_text(json.dumps(TINY | {"vocab_size": 512}))
    config = make_config(model={"config": str(model_config), "quantization": "int8"}, engine={"executor": "sim"},
                         bench={"ignore_eos": True}, sim={"hardware": "l40s"})  # fmt: skip
    sim = load_sim_model(config)
    assert sim.weights.name == "int8" and sim.runtime()["weights"] == "int8"
    assert sim.cost_model().weights == sim.weights

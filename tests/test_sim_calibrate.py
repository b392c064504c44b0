"""Local hardware rows (cpu-local, cuda-local): calibration by device, the forward fit on bm's own engine,
and the fit pricing a simulated run. There is no GPU in CI: the code a GPU runs is exercised with device
cpu, and a cuda-local row written by hand stands for a measured one. No test asserts a time measured."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
import yaml

from bm.config import ConfigError, load_config
from bm.engine.execution.fake_executor import FakeExecutor
from bm.engine.step.core import EngineCore
from bm.runtime.model_loader import ModelConfig
from bm.sim import CostModel, ModelShape, load_hardware
from bm.sim.forward_fit import (
    CPU_TERMS,
    CUDA_BUDGET,
    CUDA_DECODE_CELLS,
    TERMS,
    Design,
    cuda_design,
    design_config,
    drive,
    measure_forward_fit,
    model_key,
    nnls,
)
from bm.sim.hardware import calibrate, default_device, ensure_forward_fit, local_row_name, local_row_path
from bm.sim.work import work_totals
from tests.recorder import Recorder

TINY = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 64,
        "max_position_embeddings": 2048}  # fmt: skip


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory, and GEMMs small enough to calibrate in a moment (the fields are
    measured; their values are not asserted)."""
    monkeypatch.setenv("BM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("bm.sim.calibration.CPU_GEMM", ((16, 64), 64))
    return tmp_path


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


def write_row(name: str, device: str, terms: dict[str, float], shape: ModelShape, dtype: str, **fields):
    """A local row as calibration leaves it, with a forward fit already cached for ``shape``."""
    row = {
        "name": name, "device": device, "flops": {dtype: 1e12}, "memory_bw": 1e11, "memory": 1e10,
        "interconnect_bw": 0.0, "price_per_hour": 1.0, "source": "test", "compute_efficiency": 1.0,
        "memory_efficiency": 1.0, "iteration_overhead_s": 0.125, "layer_overhead_s": 0.0,
        "forward_fits": {model_key(shape.shape_dict(), dtype): {"terms": terms}},
    } | fields  # fmt: skip
    local_row_path(name).write_text(yaml.safe_dump(row))


# -- the row, by device ----------------------------------------------------------------------------------


def test_calibrate_on_the_cpu_writes_the_cpu_local_row_with_its_measured_fields(cache):
    row = calibrate(device="cpu")
    assert yaml.safe_load((cache / "cpu-local.yaml").read_text()) == row
    assert row["device"] == "cpu"
    assert row["source"].startswith("measured by `bm sim calibrate --device cpu`")
    assert row["flops"]["float32"] > 0 and row["memory_bw"] > 0 and row["memory"] > 0
    assert row["iteration_overhead_s"] > 0 and row["layer_overhead_s"] > 0
    assert set(row["gemm_curves"]) == {"float32"} and set(row["gemm_curves"]["float32"]["points"]) == {16, 64}
    assert "graph_max_batch_size" not in row  # no CUDA graphs on a CPU
    hardware = load_hardware("cpu-local")
    assert hardware.key == "cpu-local" and hardware.extra["device"] == "cpu"
    assert load_hardware("cpu-local") == hardware  # read back, not measured again


def test_each_device_has_its_own_local_row(cache):
    assert local_row_name("cpu") == "cpu-local"
    assert local_row_name("cuda") == local_row_name("cuda:1") == "cuda-local"
    for wrong in ("tpu", "cuda:x", "cpu:0"):
        with pytest.raises(ConfigError, match="no local hardware row measures it"):
            local_row_name(wrong)
    assert local_row_path("cuda-local") == cache / "cuda-local.yaml"
    with pytest.raises(ConfigError, match=r"cuda-local: .*cuda-local.yaml is missing; run `bm sim"):
        load_hardware("cuda-local", calibrate_if_missing=False)
    with pytest.raises(ConfigError, match=r"allowed: h100-sxm, .*, cpu-local, cuda-local"):
        load_hardware("h300")
    if not torch.cuda.is_available():
        assert default_device() == "cpu"
        with pytest.raises(ConfigError, match="CUDA is not available here"):
            load_hardware("cuda-local")  # calibrated first when missing: on its own device


def test_sim_calibrate_with_device_cpu_writes_cpu_local_and_says_where(cache):
    from typer.testing import CliRunner

    from bm.cli.main import app

    result = CliRunner().invoke(app, ["sim", "calibrate", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert f"written: {cache / 'cpu-local.yaml'} (cpu-local)" in result.output
    assert "memory_bw" in result.output
    wrong = CliRunner().invoke(app, ["sim", "calibrate", "--device", "tpu"])
    assert wrong.exit_code == 2 and "no local hardware row measures it" in wrong.output


# -- the forward fit ----------------------------------------------------------------------------------------


def synthetic_forwards(rng: np.random.Generator, n: int = 80) -> np.ndarray:
    """Totals in TERMS order of forwards shaped as a calibration's: decode steps (tokens = rows = batch,
    pairs = keys = the batch's context) and prompt forwards (one row per prompt, pairs ~ n^2 / 2)."""
    out = []
    for i in range(n):
        if i % 2:
            batch, context = int(rng.integers(1, 257)), int(rng.integers(128, 2049))
            out.append([1, 0, batch, batch, batch * context, batch * context])
        else:
            prompts, length = int(rng.integers(1, 9)), int(rng.integers(64, 1025))
            decodes = int(rng.integers(0, 64))
            tokens, keys = prompts * length + decodes, prompts * length + decodes * 700
            pairs = prompts * length * (length + 1) // 2 + decodes * 700
            out.append([1, 1, tokens, prompts + decodes, pairs, keys])
    return np.array(out, dtype=float)


def test_the_fit_recovers_known_non_negative_coefficients_of_every_term():
    x = synthetic_forwards(np.random.default_rng(0))
    truth = np.array([2e-3, 1.5e-3, 4e-6, 2e-6, 3e-11, 2e-9])  # TERMS order
    fitted = nnls(x, x @ truth)
    assert fitted == pytest.approx(truth, rel=1e-6)


def test_the_fit_is_the_best_non_negative_one_when_least_squares_would_go_negative():
    """A term the data price below zero is held at 0 and the rest refitted (Karush-Kuhn-Tucker: no
    held term would lower the error by growing, every free term is at its optimum)."""
    rng = np.random.default_rng(1)
    x = synthetic_forwards(rng)
    y = x @ np.array([2e-3, 1e-3, 4e-6, 0.0, 3e-11, 2e-9]) * rng.uniform(0.98, 1.02, len(x))
    y -= 2e-6 * x[:, 3]  # a per-row cost below zero
    unconstrained = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)[0]
    assert unconstrained.min() < 0
    fitted = nnls(x, y)
    assert (fitted >= 0).all() and fitted[3] == 0
    gradient = (x / y[:, None]).T @ (1 - (x / y[:, None]) @ fitted)  # descent direction of each term
    scale = np.linalg.norm(x / y[:, None], axis=0)
    assert (gradient[fitted == 0] / scale[fitted == 0] <= 1e-8).all()
    assert np.abs(gradient[fitted > 0] / scale[fitted > 0]).max() < 1e-8


def test_a_fit_of_every_gpu_term_runs_on_bms_engine_on_the_cpu(tiny_config):
    """The six-term fit a cuda-local row takes, on the CPU: bm's torch engine over a designed run (prompt
    forwards, eager, and decode forwards at two contexts), every term fitted and non-negative."""
    design = Design(
        runs=[[(48, 3)], [(16, 3)] * 6, [(200, 4)] * 3, [(40, 4)] * 8],
        terms=TERMS, max_batch_size=8, max_num_tokens=64, max_tokens=4096, repeats=1,
    )  # fmt: skip
    fit = measure_forward_fit(ModelConfig(config=str(tiny_config), device="cpu"), design=design)
    assert fit["fitted"] == list(TERMS) and set(fit["terms"]) == set(TERMS)
    assert all(v >= 0 for v in fit["terms"].values()) and sum(fit["terms"].values()) > 0
    assert fit["device"] == "cpu" and fit["samples"] >= 20


def test_cpu_local_fits_its_four_terms_on_the_models_own_engine_run_and_caches_them(cache, tiny_config):
    """cpu-local prices this machine's forward from a short run of bm's torch engine on the model itself
    (random weights): its four terms measured and non-negative, the GPU's two left at 0, cached, used."""
    calibrate(device="cpu")
    config = load_config(None, {"model.config": str(tiny_config), "model.device": "cpu"})
    shape = ModelShape.from_file(tiny_config)
    hardware = ensure_forward_fit(config.model, shape, "float32")
    fit = hardware.forward_fit(shape, "float32")
    assert fit is not None and set(fit) == set(TERMS)
    assert all(fit[t] >= 0 for t in CPU_TERMS) and sum(fit.values()) > 0
    assert fit["per_context_forward"] == fit["per_key"] == 0.0
    assert load_hardware("cpu-local").forward_fit(shape, "float32") == fit  # cached


def test_the_forward_is_measured_on_the_rows_device_in_the_resolved_dtype(cache, tiny_config, monkeypatch):
    """A cuda-local fit runs bm's engine on CUDA in the simulated dtype with decode graphs on, whatever
    the run's own model config says; the fit is cached under the model's shape and that dtype."""
    shape = ModelShape.from_file(tiny_config)
    write_row("cuda-local", "cuda:0", {"per_forward": 1.0}, shape, "float32", graph_max_batch_size=512)
    asked = []

    def fake_fit(model_config):
        asked.append(model_config)
        return {"terms": dict.fromkeys(TERMS, 1e-3), "samples": 1}

    monkeypatch.setattr("bm.sim.forward_fit.measure_forward_fit", fake_fit)
    user = ModelConfig(config=str(tiny_config), device="cpu", dtype="float32", cuda_graphs="off")
    hardware = ensure_forward_fit(user, shape, "bfloat16", "cuda-local")
    (model_config,) = asked
    forced = (model_config.device, model_config.dtype, model_config.cuda_graphs)
    assert forced == ("cuda:0", "bfloat16", "auto")
    assert hardware.forward_fit(shape, "bfloat16") == dict.fromkeys(TERMS, 1e-3)
    assert hardware.forward_fit(shape, "float32")["per_forward"] == 1.0  # the other dtype's fit kept


# -- the fit in a simulated run ---------------------------------------------------------------------------


@pytest.mark.parametrize("row", ["cpu-local", "cuda-local"])
def test_a_simulated_run_on_a_local_row_is_timed_by_the_fit_not_the_roofline(cache, tiny_config, row):
    """Every iteration costs the fit's seconds: per forward, plus per eager forward for one that carries
    prompt tokens (on cuda-local also a decode step wider than its largest graph, here 4 rows), plus the
    row's per-iteration overhead (hidden behind the forward on cuda-local, where the engine overlaps);
    nothing of the roofline's FLOPs and bytes."""
    from bm.bench.simulated import load_sim_model, run_sim
    from bm.workloads import load_workload

    shape = ModelShape.from_file(tiny_config)
    terms = {"per_forward": 0.5, "per_context_forward": 0.25}
    graphs = {"graph_max_batch_size": 4} if row == "cuda-local" else {}
    auto = "float32" if row == "cpu-local" else "bfloat16"  # model.dtype auto on the row's device
    write_row(row, row.split("-")[0], terms, shape, auto, **graphs)
    config = load_config(None, {
        "engine.executor": "sim", "sim.hardware": row, "model.config": str(tiny_config),
        "engine.max_batch_size": 6, "bench.dataset_kind": "synthetic", "bench.num_requests": 12,
        "bench.input_len": 24, "bench.output_len": 10, "bench.range_ratio": 0.5, "bench.seed": 3,
    })  # fmt: skip
    model = load_sim_model(config)
    assert model.cost_model().fit == dict.fromkeys(TERMS, 0.0) | terms
    recorder = Recorder()
    workload = load_workload(config.bench, vocab_size=model.vocab_size, encode=None)
    result = run_sim(config, model, workload, journal=recorder)
    assert result.metrics["completed"] == 12
    kinds = set()
    for stats in recorder.stats:
        eager = stats["Context Requests"] > 0 or (row == "cuda-local" and stats["Generation Requests"] > 4)
        kinds.add(eager)
        forward, host = 0.5 + 0.25 * eager, 0.125
        # a GPU row runs overlapped, as the engine does there (engine.overlap_scheduler auto): the host's
        # per-iteration time hides behind the forward; a CPU row adds it
        expected = max(forward, host) if row == "cuda-local" else forward + host
        assert stats["Iteration Latency (ms)"] == pytest.approx(expected * 1e3)
    assert kinds == {True, False}
    roofline = CostModel(shape, load_hardware("h100-sxm"), "float32")
    assert roofline.decode_seconds(4, 400) < 0.01  # what the datasheet row would have said


def test_a_local_row_refuses_tensor_parallelism(cache, tiny_config):
    from bm.bench.simulated import load_sim_model

    write_row("cpu-local", "cpu", {"per_forward": 1.0}, ModelShape.from_file(tiny_config), "float32")
    config = load_config(None, {"engine.executor": "sim", "sim.hardware": "cpu-local",
                                "model.config": str(tiny_config), "sim.tensor_parallel": 2})  # fmt: skip
    with pytest.raises(ConfigError, match="cpu-local measures one device"):
        load_sim_model(config)


# -- the GPU's designed run ----------------------------------------------------------------------------


def test_the_gpu_design_decodes_each_cell_whole_by_graph_and_fits_the_token_budget():
    """Run through the real scheduler (a fake executor): each decode cell decodes all its requests
    together, decode-only, for at least four steps; no forward passes the 8,192-token budget or 256
    rows; the design's KV cache holds every cell at once; prompt forwards reach the budget."""
    design = cuda_design()
    assert design.terms == TERMS
    contexts = [c for _, c in CUDA_DECODE_CELLS]
    assert min(contexts) == 128 and max(contexts) == 2048 and max(b for b, _ in CUDA_DECODE_CELLS) == 256
    forwards: list[list] = []

    class Recording(FakeExecutor):
        def execute(self, batch):
            forwards.extend([work_totals(f), len(f)] for f in batch.forwards)
            return super().execute(batch)

    core = EngineCore(design_config(design, ModelConfig(device="cpu")), Recording(4096))
    ids = itertools.count()
    decode_runs = design.runs[-len(CUDA_DECODE_CELLS) :]
    drive(core, design.runs[: -len(CUDA_DECODE_CELLS)], None, ids)
    assert max(t.tokens for t, _ in forwards) == CUDA_BUDGET
    for (requests, _), run in zip(CUDA_DECODE_CELLS, decode_runs, strict=True):
        forwards.clear()
        drive(core, [run], None, ids)
        whole = [t for t, n in forwards if n == requests and not t.eager]
        assert len(whole) >= 4, (requests, len(whole))
        assert max(t.tokens for t, _ in forwards) <= CUDA_BUDGET and max(n for _, n in forwards) <= 256

"""benchmarks/profile_parts.py: its timers see every part of a run and leave the engine as they found it."""

from __future__ import annotations

from tests.benchmark_scripts import load_benchmark
from tests.conftest import make_config


def test_parts_add_up_to_the_engine_steps_and_gemms_are_timed_by_shape(tiny_model):
    from bm.engine.step.core import EngineCore
    from bm.runtime.model_runner import ModelRunner

    pp = load_benchmark("profile_parts")
    step, forward = EngineCore.__dict__["step"], ModelRunner.__dict__["forward"]
    timers = pp.Timers()
    workload = [(list(range(3, 3 + n)), 4) for n in (5, 17, 40)]
    wall, iterations, output_tokens = pp.run_profiled(tiny_model, make_config(), workload, timers)
    assert output_tokens == 12 and iterations >= 4
    assert EngineCore.__dict__["step"] is step and ModelRunner.__dict__["forward"] is forward
    report = pp.summarize(timers, wall, iterations, peak=1e11)
    parts = {k: v["seconds"] for k, v in report["parts"].items()}
    assert all(v >= 0 for k, v in parts.items() if k not in ("forward_other", "engine_python"))
    inside = sum(v for k, v in parts.items() if k != "outside_step")
    # the parts telescope to the step time; each is reported rounded to the millisecond
    assert abs(inside - timers.seconds["step"]) <= 0.5e-3 * len(parts) + 1e-9
    assert timers.calls["step"] == iterations
    config = tiny_model.model.config
    shapes = {(row["k"], row["n"]) for row in report["gemm_by_shape"]}
    # gate and up: two GEMMs, or the fused gate/up pass (AVX-512) timed as one of twice the width
    hidden, inner = config.hidden_size, config.intermediate_size
    assert (hidden, inner) in shapes or (hidden, 2 * inner) in shapes
    assert (inner, hidden) in shapes  # the down projection, with the residual add where it is fused
    assert (config.hidden_size, config.vocab_size) in shapes  # the LM head
    assert sum(flops for _, _, flops in timers.gemm.values()) > 0
    assert timers.calls["sampling"] == iterations


def test_quantized_linears_are_timed_as_gemms_and_restored():
    """A quantized model's linears run their own kernels, not the panel GEMM: without their timer, their
    time would land in forward_other (three quarters of a Q4_1 run, unattributed)."""
    from bm.runtime import load_model
    from bm.runtime.model_loader import ModelConfig
    from bm.runtime.weight_quant import KernelForward

    pp = load_benchmark("profile_parts")
    call = KernelForward.__dict__["__call__"]
    loaded = load_model(ModelConfig(device="cpu", seed=0, quantization="int8"))
    timers = pp.Timers()
    pp.run_profiled(loaded, make_config(), [(list(range(3, 20)), 3)], timers)
    assert KernelForward.__dict__["__call__"] is call
    config = loaded.model.config
    shapes = {(k, n) for _, k, n in timers.gemm}
    assert (config.hidden_size, config.intermediate_size) in shapes  # gate/up, quantized
    assert (config.intermediate_size, config.hidden_size) in shapes  # down, quantized


def test_a_preset_name_is_a_preset_and_a_directory_a_path(tmp_path):
    """``--model smollm2-135m`` names the preset as bm's own --model does, not a directory of that name."""
    import argparse

    common = load_benchmark("common")
    p = argparse.ArgumentParser()
    common.add_model_arguments(p)
    preset = common.model_overrides(p.parse_args(["--model", "smollm2-135m"]))
    assert preset["model.preset"] == "smollm2-135m" and preset["model.path"] is None
    local = common.model_overrides(p.parse_args(["--model", str(tmp_path)]))
    assert local["model.path"] == str(tmp_path) and local["model.preset"] is None

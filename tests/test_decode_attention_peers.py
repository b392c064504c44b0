"""benchmarks/decode_attention_peers.py runs on CPU (``--device cpu --small``, Triton's interpreter) without
xformers, so the GPU comparison's script cannot rot where CI has neither a GPU nor xformers: it must
report xformers' absence and still time bm's kernels against the float32 reference."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

pytest.importorskip("triton")

from tests.conftest import REPO


def _script(monkeypatch):
    """The script as a module (registered first: its dataclasses look their module up by name)."""
    name = "decode_attention_peers"
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_without_xformers_the_script_reports_its_absence_and_still_times_bm(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "xformers", None)  # `import xformers` raises, whatever is installed
    script = _script(monkeypatch)
    out = tmp_path / "peers.json"
    report = script.main(
        [
            "--device",
            "cpu",
            "--small",
            "--bm-splits",
            "1",
            "--bm-launch",
            "2:1",
            "--repeat",
            "1",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert "error" in report["xformers"] and report["versions"]["xformers"] is None
    shape = report["shapes"]["tiny-gqa3"]
    kernels = shape["kernels"]
    assert set(kernels) == {"bm", "bm_splits_1", "bm_w2_s1"}  # no xformers entry, and no crash
    assert kernels["bm_w2_s1"]["num_warps"] == 2 and kernels["bm_w2_s1"]["max_abs_diff"] < 1e-3
    # bm's automatic choice splits this tiny batch (few programs for a nominal 132-SM device): the split-KV
    # pair and the forced single-pass kernel both ran, and both agree with the float32 reference
    assert kernels["bm"]["num_splits"] > 1 and kernels["bm_splits_1"]["num_splits"] == 1
    for figures in kernels.values():
        assert "error" not in figures
        assert figures["median_ms"] > 0 and figures["step_ms"] == pytest.approx(
            2 * figures["median_ms"], rel=1e-3
        )
        assert figures["max_abs_diff"] < 2e-3  # float16 (the CPU default): a few ulps of outputs below 1
    assert kernels["bm"]["over_bm"] == 1.0 and shape["xformers_over_bm"] == {}
    assert shape["kv_bytes_per_call"] == shape["requests"] * shape["mean_context"] * 2 * 2 * 64 * 2

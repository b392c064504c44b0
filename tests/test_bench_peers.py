"""benchmarks/peers.py and throughput.py's ``--peers``: every peer runs or is reported skipped with its reason."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def peers():
    return load_benchmark("peers")


def _workload(tmp_path):
    path = tmp_path / "wl.jsonl"
    rows = [{"input_ids": [5, 6, 7], "request_output_len": 2}, {"input_ids": [8], "request_output_len": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


SMALL_CONFIG = LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, vocab_size=128
)


def test_peer_without_its_environment_is_skipped_with_the_setup_hint(peers, tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "PEERS_DIR", tmp_path / "no-peers")
    names = ["vllm-cpu", "vllm-cpu-eager", "ct2-fp32", "ct2-int8", "llamacpp-f32"]
    results = peers.run_peers(
        names, _workload(tmp_path), SMALL_CONFIG, str(tmp_path), None, 2, log=lambda m: None
    )
    assert list(results) == names
    for row in results.values():
        assert "bin/python not found" in row["skipped"] and "setup.sh" in row["skipped"]


def test_q4_1_gguf_of_another_model_than_smollm2_is_skipped_with_the_reason(peers, tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "PEERS_DIR", tmp_path)
    (tmp_path / "llamacpp" / "bin").mkdir(parents=True)
    (tmp_path / "llamacpp" / "bin" / "python").write_text("")
    results = peers.run_peers(
        ["llamacpp-q4_1"], _workload(tmp_path), SMALL_CONFIG, str(tmp_path), None, 2, log=str
    )
    assert "SmolLM2-135M only" in results["llamacpp-q4_1"]["skipped"]


def test_a_failing_peer_is_skipped_with_the_end_of_its_error_output(peers, tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "PEERS_DIR", tmp_path)
    (tmp_path / "vllm" / "bin").mkdir(parents=True)
    fake = tmp_path / "vllm" / "bin" / "python"
    fake.write_text("#!/bin/sh\necho 'no vllm here' >&2\nexit 3\n")
    fake.chmod(0o755)
    results = peers.run_peers(["vllm-cpu"], _workload(tmp_path), SMALL_CONFIG, None, "cfg.json", 2, log=str)
    assert results["vllm-cpu"]["skipped"] == "exit 3: no vllm here"


def test_peer_output_in_either_key_style_gives_one_shape(peers):
    vllm = '{"peer": "vllm-cpu", "requests": 2, "output_tokens": 5, "wall_s": 2.0, "output_tok_s": 2.5}'
    ct2 = 'log line\n{"peer": "ct2", "num_requests": 2, "output_tokens": 5, "prompt_tokens": 4, "elapsed_s": 0.5}'
    a, b = peers.parse_peer_output(vllm, prompt_tokens=4), peers.parse_peer_output(ct2, prompt_tokens=99)
    assert (a["requests"], a["prompt_tokens"], a["output_tok_s"]) == (2, 4, 2.5)
    assert (b["requests"], b["prompt_tokens"], b["output_tok_s"]) == (2, 4, 10.0)


def test_cpu_info_names_every_flag_that_picks_kernels(peers):
    info = peers.cpu_info()
    assert set(info["flags"]) == set(peers.CPU_FLAGS) and info["cpus"] >= 1


def test_peers_flag_alone_or_all_means_every_subprocess_peer_and_empty_means_none(peers):
    throughput = load_benchmark("throughput")
    assert throughput.peer_list("") == [] and throughput.peer_list("none") == []
    assert throughput.peer_list("all") == list(peers.PEER_NAMES)
    assert throughput.peer_list("hf-cb,all") == ["hf-cb", *peers.PEER_NAMES]
    with pytest.raises(SystemExit, match="unknown peer 'vllm'"):
        throughput.peer_list("vllm")


def test_bm_bench_runs_with_no_tuning_flags(peers, tmp_path):
    cmd = peers.bm_bench_command(tmp_path / "wl.jsonl", "/m", None, tmp_path / "out")
    flags = [c for c in cmd if c.startswith("-")]
    assert flags == ["-m", "--model", "--ignore-eos", "--json", "-q", "-o", "--overwrite"]


def test_the_vllm_bf16_peer_runs_compiled_vllm_in_bf16_on_the_bound_cores(peers, tmp_path):
    """vLLM's row in its default dtype for a bf16 checkpoint (issue 42): its script with --dtype bfloat16,
    compiled (no --eager), on the cores the other vLLM rows bind."""
    peer = next(p for p in peers.PEERS if p.name == "vllm-cpu-bf16")
    models = peers.PeerModels(SMALL_CONFIG, None, tmp_path)
    cmd, env = peers.peer_command(peer, models, _workload(tmp_path), 2, {"vllm": "/venv/bin/python"})
    assert cmd[0] == "/venv/bin/python" and cmd[1].endswith("vllm_peer.py")
    assert cmd[-2:] == ["--dtype", "bfloat16"] and "--eager" not in cmd
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"

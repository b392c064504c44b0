"""Multi-rank runs on CPU with gloo: data-parallel replicas, a rank that dies, the dispatch rule.

Each multi-process test starts real ranks (``python -m bm ... --data-parallel 2``: bm launches rank 1
itself on a free port), so nothing here can clash with another run's port; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from bm.distributed.engine import TokenBalancer
from bm.engine import Request
from tests.conftest import REPO, hf_greedy, random_prompts
from tests.hang import HANG_S

RUN_TIMEOUT_S = HANG_S


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def bm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return env


def bm_command(*args: object) -> list[str]:
    return [sys.executable, "-m", "bm", *map(str, args), "--quiet", "--set", "model.device=cpu"]


def write_prompts(path: Path, count: int, max_tokens: int) -> Path:
    lines = [
        json.dumps({"id": f"p{i}", "prompt": "word " * (3 + (7 * i) % 23), "max_tokens": max_tokens})
        for i in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_two_data_parallel_replicas_give_the_single_process_outputs_and_split_the_requests(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 12, 12)
    single = CliRunner().invoke(
        app, ["run", str(prompts), "-o", str(tmp_path / "dp1"), "--quiet", "--set", "model.device=cpu"]
    )
    assert single.exit_code == 0, single.output
    work = tmp_path / "cwd"
    work.mkdir()
    done = subprocess.run(
        bm_command("run", prompts, "-o", tmp_path / "dp2", "--data-parallel", 2),
        cwd=work,
        env=bm_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    one, two = read_jsonl(tmp_path / "dp1" / "outputs.jsonl"), read_jsonl(tmp_path / "dp2" / "outputs.jsonl")
    assert sorted(r["index"] for r in two) == list(range(12))  # exactly one record per input
    assert {r["index"]: r["output_ids"] for r in two} == {r["index"]: r["output_ids"] for r in one}
    assert all(r["error"] is None for r in two)

    summary = json.loads((tmp_path / "dp2" / "summary.json").read_text())
    parallel = summary["parallel"]
    assert (parallel["data_parallel"], parallel["tensor_parallel"], parallel["world_size"]) == (2, 1, 2)
    per_replica = [r["num_requests"] for r in parallel["replicas"]]
    assert sum(per_replica) == 12 and min(per_replica) > 0
    assert json.loads((tmp_path / "dp1" / "summary.json").read_text())["parallel"]["world_size"] == 1

    # one stats line per iteration per replica, each tagged with the layout; only rank 0 wrote
    stats = read_jsonl(tmp_path / "dp2" / "stats.jsonl")
    assert all((s["DP Size"], s["TP Size"]) == (2, 1) for s in stats)
    for replica in parallel["replicas"]:
        counters = [s["Iteration Counter"] for s in stats if s["DP Rank"] == replica["dp_rank"]]
        assert (
            counters == list(range(1, len(counters) + 1)) and len(counters) == replica["num_iterations"] > 0
        )
    assert list(work.iterdir()) == []  # no rank wrote anything where it ran


def test_bench_with_two_replicas_merges_their_metrics_and_keeps_each_replicas_figures(tmp_path):
    out = tmp_path / "bench"
    done = subprocess.run(
        bm_command(
            "bench", "--dataset-kind", "synthetic", "--num-requests", 10, "--input-len", 12,
            "--output-len", 6, "--ignore-eos", "-o", out, "--data-parallel", 2,
        ),
        env=bm_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["completed"] == 10 and results["total_output_tokens"] == 60
    parallel = results["parallel"]
    assert (parallel["data_parallel"], parallel["tensor_parallel"]) == (2, 1)
    replicas = parallel["replicas"]
    assert [r["num_requests"] for r in replicas] == [5, 5]  # equal requests: the token count splits evenly
    assert sum(r["num_output_tokens"] for r in replicas) == 60
    stats = read_jsonl(out / "stats.jsonl")
    assert results["num_iterations"] == len(stats) == sum(r["num_iterations"] for r in replicas)
    assert len(read_jsonl(out / "requests.jsonl")) == 10


def test_a_request_goes_to_the_replica_with_the_fewest_outstanding_tokens_not_the_next_one():
    balancer = TokenBalancer(2)
    free = [8, 8]
    long_one = Request(0, [1] * 100, 100)
    assert balancer.assign(long_one, free) == 0
    # round-robin would send the second request to replica 1 and the third back to the busy replica 0
    assert [balancer.assign(Request(i, [1] * 10, 10), free) for i in (1, 2, 3)] == [1, 1, 1]
    assert balancer.outstanding == [200, 60]
    balancer.progress(0, 150, final=True)  # the long request ends: replica 0 is idle again
    assert balancer.outstanding == [0, 60]
    assert balancer.assign(Request(4, [1] * 10, 10), free) == 0
    assert balancer.assign(Request(5, [1] * 10, 10), [0, 8]) == 1  # a full replica is passed over


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _is_our_rank(pid: int) -> bool:
    try:
        return "--data-parallel" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def _wait_for_records(path: Path, count: int, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if path.exists() and len(read_jsonl(path)) >= count:
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {count} records: {proc.communicate()}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no {count} records within the deadline")


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds rank 1 through /proc")
@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_rank_that_dies_or_hangs_ends_the_run_within_the_timeout_with_a_record_per_request(tmp_path, fault):
    count = 24
    prompts = write_prompts(tmp_path / "p.jsonl", count, 200)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        bm_command(
            "run", prompts, "-o", out, "--data-parallel", 2, "--rank-timeout", 4,
            "--ignore-eos", "--set", "engine.max_batch_size=2",
        ),
        env=bm_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    rank1 = None
    try:
        _wait_for_records(out / "outputs.jsonl", 1, proc, time.monotonic() + RUN_TIMEOUT_S)
        (rank1,) = _children(proc.pid)
        os.kill(rank1, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if rank1 is not None and _is_our_rank(rank1):  # never leave a stopped rank behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank1, signal.SIGKILL)
    assert proc.returncode == 1, stdout + stderr
    assert "rank" in stderr and "--rank-timeout 4s" in stderr  # errors go to stderr (issue 41)

    records = read_jsonl(out / "outputs.jsonl")
    assert sorted(r["index"] for r in records) == list(range(count))
    finished = [r for r in records if r["error"] is None]
    failed = [r for r in records if r["error"] is not None]
    assert finished and failed  # the fault ended the run early: a hung rank did not just slow it down
    assert all(r["num_output_tokens"] == 200 and r["finish_reason"] == "length" for r in finished)
    assert all(r["finish_reason"] == "error" and "did not finish" in r["error"] for r in failed)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_failed"] == len(failed) and "failed" in summary["parallel"]["fault"]
    assert Counter(r["finish_reason"] for r in records)["error"] == len(failed)


def _single_and_two_shards(
    tmp_path: Path, checkpoint: Path, specs: list, settings: list[str]
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """``bm run`` of ``specs`` on ``checkpoint`` in this process (into tmp_path/tp1) and over two
    tensor-parallel ranks (tmp_path/tp2), with ``--set`` ``settings``: each run's output ids by line."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p, "max_tokens": m}) + "\n" for p, m in specs))
    common = ["--model", checkpoint, "--ignore-eos", *[a for kv in settings for a in ("-s", kv)]]
    single = CliRunner().invoke(
        app,
        ["run", str(prompts), "-o", str(tmp_path / "tp1"), *map(str, common), "-q", "-s", "model.device=cpu"],
    )
    assert single.exit_code == 0, single.output
    done = subprocess.run(
        bm_command("run", prompts, "-o", tmp_path / "tp2", "--tensor-parallel", 2, *common),
        env=bm_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    one = {r["index"]: r["output_ids"] for r in read_jsonl(tmp_path / "tp1" / "outputs.jsonl")}
    two = {r["index"]: r["output_ids"] for r in read_jsonl(tmp_path / "tp2" / "outputs.jsonl")}
    assert sorted(two) == list(range(len(specs)))
    return one, two


def test_two_tensor_parallel_shards_give_hf_generate_and_the_single_process_outputs(
    tmp_path, tiny_model, tiny_reference
):
    checkpoint = tmp_path / "ckpt"
    tiny_reference.save_pretrained(checkpoint)  # the tiny model's weights, as a checkpoint to shard
    specs = random_prompts(seed=1, count=24, vocab=tiny_model.vocab_size, max_prompt=48, max_output=24)
    settings = ["engine.max_batch_size=8", "engine.max_num_tokens=96", "kv_cache.tokens_per_block=8"]
    one, two = _single_and_two_shards(tmp_path, checkpoint, specs, settings)
    assert two == one
    for i, (prompt, max_new) in enumerate(specs):
        assert two[i] == hf_greedy(tiny_reference, prompt, max_new), f"request {i}"
    parallel = json.loads((tmp_path / "tp2" / "summary.json").read_text())["parallel"]
    assert (parallel["tensor_parallel"], parallel["data_parallel"]) == (2, 1)
    assert parallel["kv_heads_per_rank"] == [1]  # 2 KV heads split over 2 ranks: each caches its own
    stats = read_jsonl(tmp_path / "tp2" / "stats.jsonl")  # one line per iteration, not one per shard
    assert [s["Iteration Counter"] for s in stats] == list(range(1, len(stats) + 1))
    assert all((s["TP Size"], s["DP Size"]) == (2, 1) for s in stats)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_two_tensor_parallel_shards_of_weights_quantized_on_load_give_the_single_process_outputs(
    tmp_path, tiny_model, tiny_reference, scheme
):
    """model.quantization: int8 or fp8 under --tensor-parallel 2: each rank quantizes its shard (a
    row-split layer's scales from the whole row's maximum), so the two ranks hold the single-process
    layer's codes between them, and both runs give HF generate()'s tokens on the expanded weights."""
    import copy

    import torch

    from bm.runtime.group_linears import fp8_rows
    from bm.runtime.weight_quant import dequantized, quantize_weight, quantized_linears

    checkpoint = tmp_path / "ckpt"
    tiny_reference.save_pretrained(checkpoint)
    expanded = copy.deepcopy(tiny_reference)
    with torch.no_grad():
        for _, linear in quantized_linears(expanded):
            w = linear.weight
            linear.weight.copy_(
                dequantized(*quantize_weight(w)) if scheme == "int8" else fp8_rows(w).expanded()
            )
    specs = random_prompts(seed=4, count=12, vocab=tiny_model.vocab_size, max_prompt=40, max_output=12)
    one, two = _single_and_two_shards(
        tmp_path, checkpoint, specs, [f"model.quantization={scheme}", "engine.max_batch_size=8"]
    )
    assert two == one
    for i, (prompt, max_new) in enumerate(specs):
        assert two[i] == hf_greedy(expanded, prompt, max_new), f"request {i}"
    # the full-width model answers some of them otherwise: full-width shards would have failed above
    assert any(two[i] != hf_greedy(tiny_reference, p, m) for i, (p, m) in enumerate(specs))


def test_data_and_tensor_parallel_compose_into_two_replicas_of_two_shards(
    tmp_path, tiny_model, tiny_reference
):
    checkpoint = tmp_path / "ckpt"
    tiny_reference.save_pretrained(checkpoint)
    specs = random_prompts(seed=3, count=8, vocab=tiny_model.vocab_size, max_prompt=24, max_output=12)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p, "max_tokens": m}) + "\n" for p, m in specs))
    done = subprocess.run(
        bm_command(
            "run", prompts, "-o", tmp_path / "out", "--model", checkpoint, "--ignore-eos",
            "--tensor-parallel", 2, "--data-parallel", 2,
        ),
        env=bm_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    outputs = {r["index"]: r["output_ids"] for r in read_jsonl(tmp_path / "out" / "outputs.jsonl")}
    assert sorted(outputs) == list(range(len(specs)))
    for i, (prompt, max_new) in enumerate(specs):
        assert outputs[i] == hf_greedy(tiny_reference, prompt, max_new), f"request {i}"
    parallel = json.loads((tmp_path / "out" / "summary.json").read_text())["parallel"]
    assert (parallel["tensor_parallel"], parallel["data_parallel"], parallel["world_size"]) == (2, 2, 4)
    assert parallel["kv_heads_per_rank"] == [1]
    assert all(r["num_requests"] > 0 for r in parallel["replicas"])
    stats = read_jsonl(tmp_path / "out" / "stats.jsonl")
    assert sorted({s["DP Rank"] for s in stats}) == [0, 1]
    assert all((s["TP Size"], s["DP Size"]) == (2, 2) for s in stats)


def test_tensor_parallel_refuses_a_model_built_from_a_config_naming_why(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 2, 4)
    result = CliRunner().invoke(
        app, ["run", str(prompts), "-o", str(tmp_path / "out"), "--tensor-parallel", "2", "-q"]
    )
    assert result.exit_code == 2, result.output
    assert "--tensor-parallel needs model.path" in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()


def test_a_lora_request_under_tensor_parallelism_is_refused_naming_the_field_and_the_fix():
    """Adapter weights are not split like the shards' projections, so a LoRA request is refused at
    admission (an error response naming lora_task_id) rather than failing inside the forward."""
    from bm.distributed.engine import ParallelExecutor
    from bm.engine.execution.fake_executor import FakeExecutor
    from bm.engine.requests.request import RequestError, RequestLimits
    from bm.engine.requests.validate import validate_request
    from bm.parallel.layout import ParallelLayout

    limits = RequestLimits(vocab_size=64, max_seq_len=64, max_num_tokens=None, max_beam_width=1)
    lora = {"lora_task_id": 1, "lora_config": [[1, 0, 1]], "lora_weights": [[0.5] * 8]}
    sharded = ParallelExecutor(FakeExecutor(), ParallelLayout(tensor_parallel=2, rank=0))
    with pytest.raises(RequestError, match=r"lora_task_id: .*tensor parallelism.*--tensor-parallel 1"):
        sharded.admit(validate_request(Request(0, [5, 6], 2, **lora), limits))
    sharded.admit(validate_request(Request(1, [5, 6], 2), limits))  # requests without an adapter pass
    whole = ParallelExecutor(FakeExecutor(), ParallelLayout(data_parallel=2, rank=0))
    whole.admit(validate_request(Request(2, [5, 6], 2, **lora), limits))  # a replica runs adapters whole


def test_cuda_runs_use_nccl_for_tensors_and_gloo_for_bm_exchanges():
    from bm.parallel.layout import _device_type, process_group_backend

    assert process_group_backend(_device_type("cuda:1")) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(_device_type("cpu")) == "gloo"


# Rank 0 as a Ray replica is: it starts its ranks without a command line to rerun, then its process
# dies (here before the ranks even meet, the case no socket reports: a rank would retry the rendezvous
# for the whole startup timeout).
ORPHANING_RANK_0 = """
import os, threading, time
from bm.config import config_from_dict
from bm.parallel.layout import launched_ranks
from bm.distributed.worker import start_replica_ranks

config = config_from_dict({"model": {"device": "cpu"}})
threading.Thread(target=start_replica_ranks, args=(config, 2, 300.0, 1), daemon=True).start()
while not launched_ranks():
    time.sleep(0.01)
print(launched_ranks()[0], flush=True)
os._exit(0)
"""


def test_a_rank_started_without_a_command_line_exits_when_its_rank_0_dies(tmp_path):
    """``python -m bm.distributed.worker`` (the ranks of a ``--ray`` replica) must not outlive its rank 0:
    a killed actor's ranks would otherwise hold its memory and GPUs while Ray restarts it."""
    with (tmp_path / "stderr").open("w") as stderr:  # a file: rank 1 inherits it, a pipe would wait for it
        rank0 = subprocess.Popen(
            [sys.executable, "-c", ORPHANING_RANK_0],
            env=bm_env(),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        line = rank0.stdout.readline()
        assert rank0.wait(timeout=HANG_S) == 0 and line.strip(), (tmp_path / "stderr").read_text()
    rank1 = int(line)
    deadline = time.monotonic() + HANG_S  # the wait is for rank 1's exit; this only bounds a hang
    while _is_alive(rank1):
        if time.monotonic() > deadline:
            os.kill(rank1, signal.SIGKILL)
            pytest.fail(f"rank 1 (pid {rank1}) outlived its rank 0 by {HANG_S:g} s")
        time.sleep(0.1)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in _state_of(pid)


def _state_of(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    return ""

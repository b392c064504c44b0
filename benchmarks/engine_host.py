#!/usr/bin/env python3
"""The engine's host time per iteration, without a model: what overlap scheduling cannot hide.

    python benchmarks/engine_host.py [--requests 64,256,1024] [--overlap off,on] [--repeats 5]
        [--max-batch-size B] [--executor fake|torch] [--sampling greedy|sampled] [--profile N]

Each run admits N requests at once (prompts of 256-511 random tokens, 128 output tokens, end tokens never
sampled) into an :class:`~bm.engine.EngineCore`, with ``max_batch_size`` N (``--max-batch-size B``: B,
the rest queued), ``max_num_tokens`` 8192, chunked context, the engine's default blocks (32 tokens), no
block reuse and a cache that holds ``max_batch_size`` requests to completion, and steps it until every
request has ended.

``--executor fake`` (the default): over the fake executor (no torch). Every step is timed, and apart
from it the fake executor's ``execute`` (which checks every position's block and hashes each token):
``core`` is the difference, i.e. scheduling, KV block bookkeeping, batch building, applying tokens,
stopping checks, responses and stats.

``--executor torch``: over the torch executor on the GPU's code path, on the CPU, with only the model
call stubbed: a one-layer Llama (vocabulary 256) whose forward returns rows of a fixed logits tensor,
behind the Triton attention backend with its static decode buffers (``model.cuda_graphs: on``), so the
step's metadata, the static buffers' fill, the overlap path's input fill, sampling on the "device" and
the token copy all run as on a GPU, minus the CUDA calls. ``core`` is then the host's whole step (the
core and the executor's host side) and ``executor`` the stubbed model call: what a GPU's device step
must outlast for overlap to hide the host (an H100's 256-row decode step of a 1B Llama: about 4-5 ms).

``--sampling sampled``: every request samples (temperature 0.8, top-p 0.95, its own seed) instead of
taking the argmax. Over the torch executor the sampler then runs on the CPU as it would on a GPU (its
filtering and sort are device work there, counted here as the host's: small at the stub's 256-token
vocabulary), with each row's uniform number drawn from its request's CPU generator, host work anywhere.

Prints JSON: for each request count and overlap setting, the core's ms per iteration over the whole run
and its median over the decode iterations (no context token in the batch), each as the median of the
repeats with every repeat listed, and the executor's own ms per iteration beside them. Repeats run
alternated (every setting once, then again), so a drift of the machine touches all settings alike.
``--profile N``: a cProfile of the steps (executor included) of one run at N requests, to stderr.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import random
import statistics
import sys
import time

from bm.config import KvCacheConfig, config_from_dict
from bm.engine import EngineCore, Request
from bm.engine.execution.fake_executor import FakeExecutor
from bm.engine.execution.protocol import ExecutionBatch, ExecutionResult, WorkKind

PROMPT_TOKENS = (256, 512)  # drawn from [low, high)
OUTPUT_TOKENS = 128
MAX_NUM_TOKENS = 8192
TOKENS_PER_BLOCK = KvCacheConfig().tokens_per_block  # the engine's default (32)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


STUB_VOCAB = 256
_TORCH: list = []  # (the stubbed torch executor, its sink), built once per process


def torch_executor(sink: list[list[tuple[float, bool]]]):
    """The torch executor on the GPU's code path over a one-layer Llama whose model call is stubbed (see
    the module docstring); each stubbed call appends its seconds and whether it was a decode step to
    ``sink[0]`` (the current run's list: runs share the executor, as bm.LLM's generate calls do)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bm.runtime.backends import ENV_SWITCH
    from bm.runtime.executor import TorchExecutor
    from bm.runtime.model_loader import describe_model
    from bm.runtime.model_runner import ModelRunner
    from bm.runtime.triton.graphs import DecodeGraphs

    os.environ[ENV_SWITCH] = "triton"  # the Triton backend's metadata and static buffers, as on CUDA
    config = AutoConfig.for_model(
        "llama", vocab_size=STUB_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    loaded = describe_model(
        model, None, "stub", prepack="off", fused_elementwise="off", fused_projections="off"
    )
    loaded.cuda_graphs = "on"
    logits = torch.randn(8192, STUB_VOCAB)
    logits[:, :3] = float("-inf")  # no end token (the config's is 2): every request runs to its length

    def stub(rows: int, decoding: bool) -> torch.Tensor:
        t = time.perf_counter()
        out = logits[:rows]
        sink[0].append((time.perf_counter() - t, decoding))
        return out

    ModelRunner._run_model = lambda self, inputs, embeds=None: stub(inputs.logits_index.shape[0], False)
    DecodeGraphs._forward = lambda self, bucket: stub(bucket, True)
    return TorchExecutor(loaded)


def make_core(
    num_requests: int,
    overlap: str,
    max_batch_size: int | None = None,
    kind: str = "fake",
    sampling: str = "greedy",
) -> tuple[EngineCore, list[tuple[float, bool]]]:
    """A core over the fake executor whose ``execute`` records its own seconds and whether the batch was a
    pure decode (one entry per call), or over the stubbed torch executor (:func:`torch_executor`), with
    every request admitted (``max_batch_size``: default all)."""
    batch = max_batch_size or num_requests
    config = config_from_dict(
        {
            "engine": {
                "max_batch_size": batch,
                "max_num_tokens": MAX_NUM_TOKENS,
                "enable_chunked_context": True,
                "overlap_scheduler": overlap,
            },
            "kv_cache": {
                "tokens_per_block": TOKENS_PER_BLOCK,
                "max_tokens": batch * (PROMPT_TOKENS[1] + OUTPUT_TOKENS) + TOKENS_PER_BLOCK,
                "enable_block_reuse": False,
            },
        }
    )
    spent: list[tuple[float, bool]] = []
    if kind == "torch":
        if not _TORCH:
            sink: list[list[tuple[float, bool]]] = [spent]
            _TORCH.append((torch_executor(sink), sink))
        executor, sink = _TORCH[0]
        sink[0], vocab = spent, STUB_VOCAB
    else:
        executor, vocab = FakeExecutor(1000, device_type="cpu"), 1000
        execute = executor.execute

        def timed(batch: ExecutionBatch) -> ExecutionResult:
            t = time.perf_counter()  # what this wrapper reads of the batch counts as the executor's
            decoding = all(i.kind is WorkKind.GENERATION for forward in batch.forwards for i in forward)
            try:
                return execute(batch)
            finally:
                spent.append((time.perf_counter() - t, decoding))

        executor.execute = timed  # the core's launcher reads it when the core is built
    core = EngineCore(config, executor)
    rng = random.Random(3)
    for i in range(num_requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(*PROMPT_TOKENS))]
        sample = (
            {"temperature": 0.8, "runtime_top_p": 0.95, "random_seed": i} if sampling == "sampled" else {}
        )
        refused = core.add_request(Request(i, prompt, OUTPUT_TOKENS, **sample))
        if refused is not None:
            raise SystemExit(f"request {i} refused: {refused.error}")
    return core, spent


def run_once(
    num_requests: int,
    overlap: str,
    max_batch_size: int | None = None,
    profiler: cProfile.Profile | None = None,
    kind: str = "fake",
    sampling: str = "greedy",
) -> dict:
    """One run to completion: the core's and the executor's seconds, per step."""
    core, spent = make_core(num_requests, overlap, max_batch_size, kind, sampling)
    clock = time.perf_counter
    core_s: list[float] = []
    exec_s: list[float] = []
    decode: list[bool] = []
    gc.collect()
    while core.num_active or core.in_flight:
        before = len(spent)
        if profiler is not None:
            profiler.enable()
        t = clock()
        core.step()
        elapsed = clock() - t
        if profiler is not None:
            profiler.disable()
        executed = sum(s for s, _ in spent[before:])
        core_s.append(elapsed - executed)
        exec_s.append(executed)
        decode.append(len(spent) > before and all(d for _, d in spent[before:]))
    steps = len(core_s)
    decode_core = [s for s, d in zip(core_s, decode, strict=True) if d]
    return {
        "iterations": steps,
        "core_ms": sum(core_s) / steps * 1e3,
        "decode_core_ms": statistics.median(decode_core) * 1e3 if decode_core else None,
        "executor_ms": sum(exec_s) / steps * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="64,256,1024", help="comma list of request counts")
    p.add_argument("--overlap", default="off,on", help="comma list of engine.overlap_scheduler values")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-batch-size", type=int, default=None, help="default: each run's request count")
    p.add_argument("--executor", choices=["fake", "torch"], default="fake",
                   help="fake (the core alone) or torch (the GPU code path's host side, model stubbed)")  # fmt: skip
    p.add_argument("--sampling", choices=["greedy", "sampled"], default="greedy",
                   help="every request greedy, or sampling (temperature, top-p, a seed each)")  # fmt: skip
    p.add_argument("--profile", type=int, default=None, metavar="N", help="cProfile one run at N requests")
    p.add_argument("--sort", default="tottime", help="the profile's order (tottime, cumulative)")
    args = p.parse_args()
    counts = [int(n) for n in args.requests.split(",")]
    overlaps = args.overlap.split(",")

    if args.profile is not None:
        profiler = cProfile.Profile()
        run_once(args.profile, overlaps[0], args.max_batch_size, profiler, args.executor, args.sampling)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats(args.sort).print_stats(40)
    if args.repeats <= 0:
        return

    runs: dict[tuple[int, str], list[dict]] = {(n, o): [] for n in counts for o in overlaps}
    kinds = {"kind": args.executor, "sampling": args.sampling}
    run_once(counts[0], overlaps[0], args.max_batch_size, **kinds)  # warm-up: imports, caches
    for repeat in range(args.repeats):
        for n in counts:
            for overlap in overlaps:
                run = run_once(n, overlap, args.max_batch_size, **kinds)
                runs[n, overlap].append(run)
                log(
                    f"repeat {repeat + 1}/{args.repeats} requests {n} overlap {overlap}: core "
                    f"{run['core_ms']:.3f} ms/iteration, decode {run['decode_core_ms']:.3f} ms, "
                    f"executor {run['executor_ms']:.3f} ms"
                )

    def summary(values: list[float]) -> dict:
        return {"median": round(statistics.median(values), 3), "all": [round(v, 3) for v in values]}

    results = []
    for (n, overlap), done in runs.items():
        results.append(
            {
                "requests": n,
                "overlap": overlap,
                "iterations": done[0]["iterations"],
                "core_ms_per_iteration": summary([r["core_ms"] for r in done]),
                "decode_core_ms": summary([r["decode_core_ms"] for r in done]),
                "executor_ms_per_iteration": summary([r["executor_ms"] for r in done]),
            }
        )
    workload = {
        "prompt_tokens": list(PROMPT_TOKENS),
        "output_tokens": OUTPUT_TOKENS,
        "max_num_tokens": MAX_NUM_TOKENS,
        "tokens_per_block": TOKENS_PER_BLOCK,
        "max_batch_size": args.max_batch_size or "requests",
        "executor": args.executor,
        "sampling": args.sampling,
        "core_is": "the core" if args.executor == "fake" else "the host's whole step (core + torch executor)",
    }
    print(json.dumps({"workload": workload, "repeats": args.repeats, "results": results}, indent=1))


if __name__ == "__main__":
    main()

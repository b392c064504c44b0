"""vLLM's defaults through bm.LLM: every row of docs/library.md's defaults table is what bm does, a row
where bm keeps its own says so, the checkpoint's generation_config.json is taken as vLLM takes it, and
SamplingParams(n=4) draws 4 different, reproducible samples."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

import bm
from bm.llm_config import build_config
from tests.conftest import reference_model

KV = {"max_tokens": 4096, "tokens_per_block": 8}
DOCS = Path(__file__).resolve().parents[1] / "docs" / "library.md"


def defaults_table() -> list[tuple[str, str, object, object, str]]:
    """(owner, name, vLLM default, bm default, notes) for each row of the docs' defaults table."""
    text = DOCS.read_text()
    section = text[text.index("### Defaults: vLLM's") :]
    rows = []
    for line in section.splitlines()[1:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].startswith("`"):
            if rows and not line.startswith("|"):
                break
            continue
        owner, name, vllm, ours, notes = cells
        rows.append(
            (
                owner.strip("`"),
                name.strip("`"),
                *(ast.literal_eval(v.strip("`")) for v in (vllm, ours)),
                notes,
            )
        )
    return rows


ROWS = defaults_table()


@pytest.fixture(scope="module")
def llm() -> bm.LLM:
    return bm.LLM(model="tiny-random", device="cpu", kv_cache=KV)


# LLM keyword -> what a default-built LLM has for it
LLM_VALUES = {
    "seed": lambda llm: llm.seed,
    "generation_config": lambda llm: llm.options.generation_config,
    "enable_lora": lambda llm: llm.options.enable_lora,
    "max_loras": lambda llm: llm.config.peft_cache.max_adapters,
    "max_lora_rank": lambda llm: llm.options.max_lora_rank,
    "dtype": lambda llm: build_config(None, None, {}).model.dtype,
    "max_model_len": lambda llm: build_config(None, None, {}).engine.max_seq_len,
    "gpu_memory_utilization": lambda llm: llm.config.kv_cache.free_memory_fraction,
    "block_size": lambda llm: build_config(None, None, {}).kv_cache.tokens_per_block,
    "enable_prefix_caching": lambda llm: llm.config.kv_cache.enable_block_reuse,
}


def test_the_table_lists_every_sampling_parameter_and_every_llm_default_checked_here():
    names = {(owner, name) for owner, name, *_ in ROWS}
    public = {f.name for f in dataclasses.fields(bm.SamplingParams)} - {"guided_decoding", "response_format"}
    assert {n for o, n in names if o == "SamplingParams"} == public
    assert {n for o, n in names if o == "LLM"} == set(LLM_VALUES)


@pytest.mark.parametrize(
    ("owner", "name", "vllm", "ours", "notes"), ROWS, ids=[f"{r[0]}.{r[1]}" for r in ROWS]
)
def test_each_row_of_the_defaults_table_is_what_bm_does(llm, owner, name, vllm, ours, notes):
    if owner == "SamplingParams":
        got = getattr(bm.SamplingParams(), name)
    elif owner == "BeamSearchParams":
        got = getattr(bm.BeamSearchParams(beam_width=2, max_tokens=4), name)
    else:
        got = LLM_VALUES[name](llm)
    assert got == ours and type(got) is type(ours)
    if vllm != ours:
        assert "bm's own" in notes  # a default of bm's own is said to be one


def checkpoint(folder: Path, loaded, generation: dict | None) -> Path:
    reference_model(loaded).save_pretrained(folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


GENERATION = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 7}


def test_the_checkpoints_generation_config_is_the_default_unless_generation_config_is_vllm(
    tmp_path, tiny_model
):
    folder = checkpoint(tmp_path / "ckpt", tiny_model, {**GENERATION, "do_sample": True, "eos_token_id": 2})
    auto = bm.LLM(str(folder), device="cpu", kv_cache=KV)
    want = bm.SamplingParams(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, max_tokens=7)
    assert auto.get_default_sampling_params() == want
    assert bm.LLM(
        str(folder), device="cpu", kv_cache=KV, generation_config="vllm"
    ).get_default_sampling_params() == (bm.SamplingParams())
    other = checkpoint(tmp_path / "other", tiny_model, {"temperature": 0.0})
    named = bm.LLM(str(folder), device="cpu", kv_cache=KV, generation_config=str(other))
    assert named.get_default_sampling_params() == bm.SamplingParams(temperature=0.0)
    # generate() without parameters runs those defaults: the same tokens as a twin LLM given them
    twin = bm.LLM(str(folder), device="cpu", kv_cache=KV, generation_config="vllm")
    implicit = auto.generate([[5, 6, 7]])[0].token_ids
    assert implicit == twin.generate([[5, 6, 7]], want)[0].token_ids and len(implicit) <= 7
    assert twin.generate([[5, 6, 7]])[0].token_ids != implicit  # vLLM's own defaults differ


def test_a_generation_config_directory_that_does_not_exist_is_refused_naming_the_choices():
    with pytest.raises(
        bm.InvalidParameterError, match=r"LLM\(generation_config='nope/'\): not a directory; give 'auto'"
    ):
        bm.LLM("tiny-random", generation_config="nope/")


def test_sampling_params_n_4_gives_four_different_samples_reproducible_with_a_seed(llm):
    outs = llm.generate([[5, 6, 7]], bm.SamplingParams(n=4, max_tokens=6, ignore_eos=True))[0].outputs
    assert len(outs) == 4 and len({tuple(o.token_ids) for o in outs}) == 4
    seeded = bm.SamplingParams(n=4, max_tokens=6, ignore_eos=True, seed=9)
    first, again = (llm.generate([[5, 6, 7]], seeded)[0].outputs for _ in range(2))
    assert [o.token_ids for o in first] == [o.token_ids for o in again]


def test_unparameterized_generate_samples_as_vllm_does_and_duplicate_prompts_differ(llm):
    """vLLM's SamplingParams() samples at temperature 1; two equal prompts of one call sample apart."""
    greedy = llm.generate([[5, 6, 7]], bm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    a, b = llm.generate([[5, 6, 7], [5, 6, 7]], bm.SamplingParams(max_tokens=8, ignore_eos=True))
    assert a.token_ids != b.token_ids and greedy.token_ids not in (a.token_ids, b.token_ids)


def test_docs_temperature_row_says_the_default_is_vllms():
    assert re.search(r"\| `temperature` \| `temperature` \| default 1\.0, as vLLM's", DOCS.read_text())


def test_a_generation_config_value_bm_cannot_run_is_refused_naming_the_file(tmp_path, tiny_model):
    folder = checkpoint(tmp_path / "ckpt", tiny_model, {"temperature": -0.5})
    with pytest.raises(
        bm.InvalidParameterError, match=r"generation_config: .*generation_config.json asks for"
    ):
        bm.LLM(str(folder), device="cpu", kv_cache=KV)

"""``--resume`` knows the model by its files' contents (issue 53, item 3): after the model config behind
one path went from 6 layers to 2, a resume was accepted and ``outputs.jsonl`` mixed two models' records.
run.json now records a SHA-256 of every file that decides the outputs, and a resume whose files differ
is refused before the model loads, naming the file and, for a config, the key that changed."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from typer.testing import CliRunner

import bm.runfiles.model_files as model_files_module
from bm.cli.main import app
from bm.runfiles.model_files import adapter_dirs, model_files, model_files_change
from tests.conftest import REPO, make_config

runner = CliRunner()
TINY_SHAPE = REPO / "configs" / "models" / "tiny-llama.json"


def bm_run(prompts, out, *extra):
    args = ["run", str(prompts), "-o", str(out), "-q", "--max-tokens", "2", "--set", "model.device=cpu"]
    return runner.invoke(app, [*args, *map(str, extra)])


@pytest.fixture
def config_run(tmp_path):
    """A finished run of a random-weight model whose config file a later resume finds changed."""
    shape = tmp_path / "model.json"
    shutil.copy(TINY_SHAPE, shape)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [5 + i, 6, 7]}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    done = bm_run(prompts, out, "--model-config", shape)
    assert done.exit_code == 0, done.output
    return prompts, out, shape


def test_a_resume_after_the_model_config_changed_is_refused_naming_the_change(config_run):
    prompts, out, shape = config_run
    before = (out / "outputs.jsonl").read_text()
    config = json.loads(shape.read_text())
    shape.write_text(json.dumps({**config, "num_hidden_layers": 1}))  # the same path, another model
    result = bm_run(prompts, out, "--model-config", shape, "--resume")
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert f"--resume: the model changed: {shape}: num_hidden_layers 2 -> 1" in message
    assert "loading model" not in result.output  # refused before the load: it cost nothing
    assert (out / "outputs.jsonl").read_text() == before


def test_a_resume_with_the_same_model_files_is_accepted_though_their_times_changed(config_run):
    prompts, out, shape = config_run
    os.utime(shape, ns=(1, 1))  # touched, copied with -p, restored from a backup: the same contents
    result = bm_run(prompts, out, "--model-config", shape, "--resume")
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "run.json").read_text())["model_files"]["model"]
    assert recorded["path"] == str(shape) and recorded["json"]["model.json"]["num_hidden_layers"] == 2


def test_a_run_json_without_model_digests_is_refused_as_from_an_older_bm(config_run):
    prompts, out, shape = config_run
    saved = json.loads((out / "run.json").read_text())
    del saved["model_files"]
    (out / "run.json").write_text(json.dumps(saved))
    result = bm_run(prompts, out, "--model-config", shape, "--resume")
    assert result.exit_code == 2
    assert "records the model by its path only" in " ".join(result.output.split())


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint directory as the loader reads it, plus files it never reads."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "hidden_size": 64}))
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 4096)
    (ckpt / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    (ckpt / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    (ckpt / "pytorch_model.bin").write_bytes(b"a second copy")  # unread beside safetensors
    (ckpt / "README.md").write_text("about the model")
    (ckpt / "original").mkdir()
    (ckpt / "original" / "consolidated.pth").write_bytes(b"meta's copy")
    return ckpt


def test_a_checkpoint_is_known_by_the_files_its_loader_reads(checkpoint):
    files = model_files(make_config(model={"path": str(checkpoint)}), None)["model"]
    assert sorted(files["files"]) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert files["json"]["config.json"]["num_hidden_layers"] == 6


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda c: (c / "model.safetensors").write_bytes(b"\x01" * 4096), "model.safetensors of {}: its contents changed"),
        (lambda c: (c / "config.json").write_text('{"num_hidden_layers": 2, "hidden_size": 64}'), "config.json of {}: num_hidden_layers 6 -> 2"),
        (lambda c: (c / "tokenizer_config.json").write_text('{"chat_template": "other"}'), "tokenizer_config.json of {}: its contents changed"),
        (lambda c: (c / "special_tokens_map.json").write_text("{}"), "special_tokens_map.json of {}: added"),
        (lambda c: (c / "tokenizer.json").unlink(), "tokenizer.json of {}: removed"),
    ],
)  # fmt: skip
def test_a_changed_weight_tokenizer_or_template_file_is_named(checkpoint, change, named):
    config = make_config(model={"path": str(checkpoint)})
    before = model_files(config, None)
    change(checkpoint)
    assert named.format(checkpoint) in model_files_change(before, model_files(config, None))


def test_files_the_loader_never_reads_may_change(checkpoint):
    config = make_config(model={"path": str(checkpoint)})
    before = model_files(config, None)
    (checkpoint / "README.md").write_text("edited")
    (checkpoint / "pytorch_model.bin").write_bytes(b"other")
    (checkpoint / "original" / "consolidated.pth").write_bytes(b"other")
    assert model_files_change(before, model_files(config, None)) is None


def test_a_settled_file_is_not_hashed_again_until_it_changes(tmp_path, monkeypatch):
    """The recorded digest is reused while the file's device, inode, size, mtime and ctime are all the
    same; new contents behind a restored mtime change the ctime, and are hashed (and seen)."""
    monkeypatch.setattr(model_files_module, "SETTLED_S", -1e9)  # files made by the test count as settled
    monkeypatch.setattr(model_files_module, "_memo", {})
    hashed = []
    real = model_files_module._sha256
    monkeypatch.setattr(model_files_module, "_sha256", lambda path: hashed.append(path.name) or real(path))
    shape = tmp_path / "model.json"
    shape.write_text('{"num_hidden_layers": 6}')
    config = make_config(model={"config": str(shape)})
    first = model_files(config, None)
    model_files_module._memo.clear()  # as a new process (a resume) would start
    assert model_files_change(first, model_files(config, None, first)) is None
    assert hashed == ["model.json"]  # the resume reused the recorded digest
    stat = shape.stat()
    shape.write_text('{"num_hidden_layers": 2}')  # the same size, and the old mtime put back
    os.utime(shape, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert "num_hidden_layers 6 -> 2" in model_files_change(first, model_files(config, None, first))
    assert hashed == ["model.json", "model.json"]


def test_a_file_changed_just_before_its_digest_is_hashed_again_next_time(tmp_path):
    shape = tmp_path / "model.json"
    shape.write_text("{}")
    recorded = model_files(make_config(model={"config": str(shape)}), None)["model"]["files"]["model.json"]
    assert recorded["stat"] is None  # still within a timestamp tick's reach: no reuse


def test_adapters_named_by_the_prompts_file_are_part_of_the_model(tmp_path):
    adapter = tmp_path / "adapters" / "a1"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    prompts = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "x", "lora_dir": "adapters/a1"},
        {"prompt": "y"},
        {"prompt": "z", "lora_dir": str(adapter)},
    ]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert adapter_dirs(prompts) == [adapter]
    config = make_config()
    before = model_files(config, prompts)
    assert list(before) == [f"adapter {adapter}"]
    (adapter / "adapter_config.json").write_text('{"r": 16}')
    assert f"adapter_config.json of {adapter}: r 8 -> 16" in model_files_change(
        before, model_files(config, prompts)
    )

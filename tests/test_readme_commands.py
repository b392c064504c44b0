"""The README's commands run on what a user has: no ``../shared`` paths (a checkout of bm alone has none),
the headline trace read by bm directly with flags bm takes, and the smollm2-135m preset described as what
it is (a Q4_1 GGUF dequantized to fp32, not the original bf16 weights)."""

from __future__ import annotations

import re
import shlex

from typer.main import get_command

from bm.cli.main import app
from bm.config import config_reference
from tests.conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def bm_commands(text: str) -> list[list[str]]:
    """Every ``bm ...`` command of the text's bash blocks, continuation lines joined, as words."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("bm "):
                commands.append(shlex.split(line)[1:])
    return commands


def test_readme_commands_read_no_file_outside_a_checkout_of_bm():
    assert "../shared" not in README


def test_readme_headline_command_reads_the_public_azure_trace_with_bm_flags():
    figures = README.split("\n## Figures\n", 1)[1]
    assert "AzurePublicDataset" in figures and "AzureLLMInferenceTrace_conv.csv" in figures
    (words,) = [c for c in bm_commands(figures) if c[0] == "compare"]
    params = get_command(app).commands["compare"].make_context("compare", words[1:]).params
    assert str(params["dataset"]) == "AzureLLMInferenceTrace_conv.csv"
    assert params["dataset_kind"] == "azure" and params["num_requests"] == 128
    assert params["input_scale"] == 0.25 and params["output_scale"] == 0.25


def test_smollm2_preset_is_described_as_a_q4_1_gguf_not_the_bf16_weights():
    for text in (
        README,
        (REPO / "docs" / "models.md").read_text(encoding="utf-8"),
        config_reference(["model"]),
    ):
        flat = " ".join(text.split())
        assert "Q4_1" in flat and "not the original bf16 weights" in flat


DOCS = {path.name: path.read_text(encoding="utf-8") for path in sorted((REPO / "docs").glob("*.md"))}


def test_docs_send_users_to_the_public_trace_not_to_the_teams_shared_folder():
    """Issue 41: docs told users to read ``../shared/...``, which a checkout of bm does not have. Only the
    benchmark page may name that folder, on lines that say it is the team's (its peers' installer)."""
    for name, text in DOCS.items():
        for line in text.splitlines():
            if "../shared" in line:
                assert name == "performance.md" and "team" in line, f"{name}: {line}"


def test_docs_commands_on_the_public_trace_parse_and_say_where_to_get_it():
    commands = {
        name: [c for c in bm_commands(text) if "AzureLLMInferenceTrace_conv.csv" in c]
        for name, text in DOCS.items()
    }
    assert {name for name, found in commands.items() if found} >= {"compare.md", "sim.md", "sweep.md"}
    group = get_command(app)
    for name, found in commands.items():
        if found:
            assert "github.com/Azure/AzurePublicDataset" in DOCS[name], name
        for words in found:
            params = group.commands[words[0]].make_context(words[0], words[1:]).params
            assert str(params["dataset"]) == "AzureLLMInferenceTrace_conv.csv", (name, words)
            assert params["dataset_kind"] in (None, "azure"), (name, words)  # None: detected from the CSV

"""The grammar library is an optional extra: bm imports and runs without it, and a line asking for
structured output without it gets a clear error naming the install command (the rest of the run goes on).
These run whether or not llguidance is installed (its absence is simulated)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from bm.engine.requests.fields import request_field
from bm.engine.requests.request import RequestError
from tests.conftest import REPO
from tests.hang import HANG_S


@pytest.fixture
def without_llguidance(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` now raises ImportError


def test_asking_for_structured_output_without_the_library_names_the_install_command(without_llguidance):
    with pytest.raises(RequestError, match=r"pip install llguidance==") as caught:
        request_field("guided_decoding", "guided_regex", "only-without-llguidance[0-9]")
    assert str(caught.value).startswith("guided_regex: structured output needs the llguidance package")


def test_a_structured_line_without_the_library_is_that_lines_error_and_the_run_goes_on(
    tmp_path, without_llguidance
):
    prompts = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "a", "max_tokens": 3, "guided_choice": ["x", "only-without"]},
        {"prompt": "b", "max_tokens": 3},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(
        app, ["run", str(prompts), "-o", str(tmp_path / "o"), "-q", "--set", "model.device=cpu"]
    )
    records = [json.loads(x) for x in (tmp_path / "o" / "outputs.jsonl").read_text().splitlines()]
    assert "pip install llguidance" in records[0]["error"], result.output
    assert records[1]["error"] is None and records[1]["num_output_tokens"] == 3


def test_bm_runs_plain_requests_without_importing_the_grammar_library():
    code = (
        "import sys, bm\n"
        "out = bm.LLM(model='tiny-random').generate([[5, 6, 7]], bm.SamplingParams(temperature=0, max_tokens=3))\n"
        "assert len(out[0].token_ids) == 3\n"
        "print('llguidance' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=HANG_S
    )
    assert done.stdout.strip().splitlines()[-1] == "False"

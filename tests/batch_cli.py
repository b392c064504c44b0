"""``bm run`` over OpenAI batch lines, for the tests of how batch bodies are read and routed."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner, Result

from bm.cli.main import app

runner = CliRunner()


def invoke_batch(tmp_path: Path, lines: list[dict], *flags: str) -> tuple[Result, Path]:
    """``bm run`` over the batch ``lines`` with ``flags`` (not checked): the result and the output dir."""
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    args = ["run", str(batch), "-o", str(out), "-q", "--set", "model.device=cpu", *flags]
    return runner.invoke(app, args), out

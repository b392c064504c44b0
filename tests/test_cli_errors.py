"""Every ``bm`` command writes its errors to standard error, so ``2>err.log`` catches them and stdout
holds only output (issue 41: errors went to stdout; only ``bm bench --json`` used stderr)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from tests.conftest import REPO
from tests.hang import HANG_S


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "missing.jsonl"], "does not exist"),
        (["run", "p.jsonl", "--set", "engine.max_batch_sise=4"], "max_batch_sise"),
        (["run", "p.jsonl", "-o", "p.jsonl"], "is a file"),
        (["bench", "missing.jsonl"], "does not exist"),
        (["bench", "p.jsonl", "--set", "bench.warmup=-1"], "bench.warmup"),
        (["compare", "p.jsonl", "--schemes", "v1,bogus"], "bogus"),
        (["sweep", "p.jsonl", "--set", "engine.bogus=1"], "engine.bogus"),
        (["report", "nowhere"], "nowhere"),
    ],
)
def test_every_command_writes_its_errors_to_stderr(tmp_path, args, message):
    """As a shell runs it: ``bm ... >out.txt 2>err.log``; the error line lands in err.log only."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    with (tmp_path / "out.txt").open("w") as out, (tmp_path / "err.log").open("w") as err:
        code = subprocess.run(
            [sys.executable, "-m", "bm", *args],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=err,
            timeout=HANG_S,
        ).returncode
    stderr = " ".join((tmp_path / "err.log").read_text().split())
    assert code == 2
    assert stderr.startswith("error: ") and message in stderr, stderr
    assert (tmp_path / "out.txt").read_text() == ""


def test_a_run_where_no_request_succeeded_says_so_on_stderr(tmp_path):
    """After the model loaded: the summary table is output (stdout), the failure is an error (stderr)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "y" * 200_000}) + "\n")  # longer than the model takes
    result = CliRunner().invoke(app, ["run", str(prompts), "-o", str(tmp_path / "out"), "-q", "--set", "model.device=cpu"])  # fmt: skip
    assert result.exit_code == 3, result.output
    assert "no request succeeded" in result.stderr and "no request succeeded" not in result.stdout
    assert "succeeded" in result.stdout  # the summary table

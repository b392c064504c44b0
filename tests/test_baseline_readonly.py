"""A baseline is read-only (issue 53, item 2): ``bm compare --baseline base/compare.json -o base --overwrite``
failed its gate (exit 1) and wrote the regressed result over ``base/compare.json``, so the same command
then passed. No ``-o`` may write over, or with ``--overwrite`` remove, the file ``--baseline`` names:
it is refused before anything runs, naming both paths and the fix, however the paths are spelled."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from bm.cli.sweep import SWEEP_FILES
from bm.runfiles.outdir import COMPARE_FILES, OutDirError, check_baseline_kept
from tests.conftest import compare_dataset
from tests.test_sweep import SLO_FLAGS, base_overrides

runner = CliRunner()
SAVED = {"variants": {"v1": {"metrics": {"output_throughput": 100.0}}}}


@pytest.fixture
def base(tmp_path):
    """A saved comparison: ``base/compare.json``, the baseline of later runs."""
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "compare.json").write_text(json.dumps(SAVED))
    return folder


def compare(tmp_path, *extra):
    dataset = compare_dataset(tmp_path)
    args = ["compare", str(dataset), "--schemes", "v1", "--quiet", "--set", "model.device=cpu"]
    return runner.invoke(app, [*args, *map(str, extra)])


@pytest.mark.parametrize("overwrite", [True, False])
def test_compare_refuses_an_out_dir_that_would_write_over_its_baseline(tmp_path, base, overwrite):
    before = (base / "compare.json").read_bytes()
    flags = ["--overwrite"] if overwrite else []
    result = compare(tmp_path, "--baseline", base / "compare.json", "-o", base, *flags)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert f"--baseline '{base / 'compare.json'}'" in message and f"-o '{base}'" in message
    assert "give -o another directory" in message
    assert (base / "compare.json").read_bytes() == before  # nothing ran, nothing was replaced
    assert sorted(p.name for p in base.iterdir()) == ["compare.json"]


@pytest.mark.parametrize(
    "spelling",
    ["dotted", "parent", "symlinked baseline", "symlinked out", "hard link"],
)
def test_the_baseline_is_found_under_any_spelling_of_either_path(tmp_path, base, spelling, monkeypatch):
    monkeypatch.chdir(tmp_path)
    baseline, out = base / "compare.json", base
    if spelling == "dotted":
        baseline, out = type(base)("./base/./compare.json"), type(base)("base/.")
    elif spelling == "parent":
        (tmp_path / "other").mkdir()
        out = tmp_path / "other" / ".." / "base"
    elif spelling == "symlinked baseline":
        baseline = tmp_path / "link.json"
        baseline.symlink_to(base / "compare.json")
    elif spelling == "symlinked out":
        out = tmp_path / "alias"
        out.symlink_to(base, target_is_directory=True)
    else:
        baseline = tmp_path / "hard.json"
        os.link(base / "compare.json", baseline)
    with pytest.raises(OutDirError, match="give -o another directory"):
        check_baseline_kept(out, baseline, COMPARE_FILES)


def test_a_baseline_inside_a_folder_that_overwrite_removes_is_refused(tmp_path):
    out = tmp_path / "out"
    (out / "variants" / "v1").mkdir(parents=True)
    baseline = out / "variants" / "v1" / "compare.json"
    baseline.write_text(json.dumps(SAVED))
    with pytest.raises(OutDirError, match="inside variants/"):
        check_baseline_kept(out, baseline, COMPARE_FILES)


def test_a_baseline_beside_the_results_stays_allowed(tmp_path, base):
    (base / "baseline.json").write_text(json.dumps(SAVED))
    check_baseline_kept(base, base / "baseline.json", COMPARE_FILES)  # bm writes compare.json, not this
    check_baseline_kept(tmp_path / "new", base / "compare.json", COMPARE_FILES)  # another -o


def test_sweep_refuses_to_resume_into_the_directory_of_its_baseline(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"configs": {}}))
    with pytest.raises(OutDirError, match=r"is the sweep\.json that -o"):
        check_baseline_kept(out, out / "sweep.json", SWEEP_FILES)
    sets = [f"--set={k}={v}" for k, v in base_overrides().items()]
    args = ["sweep", *sets, "--schemes", "inflight", "--slo", SLO_FLAGS, "-o", str(out), "--resume"]
    result = runner.invoke(app, [*args, "--baseline", str(out / "sweep.json")])
    assert result.exit_code == 2 and "is the sweep.json that -o" in " ".join(result.output.split()), (
        result.output
    )
    assert sorted(p.name for p in out.iterdir()) == ["sweep.json"]

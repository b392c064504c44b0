"""``module:Class`` names in the config resolve beside the config file and in the working directory
(issue 26, defect 10): the scheduler page's example works with the ``bm`` script, no PYTHONPATH."""

from __future__ import annotations

import importlib
import json
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from bm.cli.main import app
from bm.config import ConfigError, load_config
from bm.kv import KVCacheManager
from bm.scheduling.factory import build_scheduler

runner = CliRunner()

SCHEDULER_MODULE = textwrap.dedent(
    """
    from bm.scheduling.capacity import GuaranteedNoEvictScheduler

    class CountingScheduler(GuaranteedNoEvictScheduler):
        plans = 0

        def plan(self, active_requests):
            type(self).plans += 1
            return super().plan(active_requests)
    """
)


@pytest.fixture
def isolated_imports(monkeypatch):
    """sys.path, sys.meta_path and sys.modules as they were, after each test (the resolution adds a
    finder for the module's name)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("bm_sched_"):
            del sys.modules[name]


def write_package(folder, name):
    """``folder/name/policies.py`` holding CountingScheduler (a package, as examples/ is)."""
    package = folder / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "policies.py").write_text(SCHEDULER_MODULE)
    return f"{name}.policies:CountingScheduler"


def kv_manager():
    return KVCacheManager(16, 8)


def config_beside_package(tmp_path, monkeypatch, name, more_yaml=""):
    """``tmp/cfg/bm.yaml`` naming CountingScheduler from the package ``name`` beside it, with the working
    directory ``tmp/elsewhere`` (so only the config's folder can explain the module being found)."""
    config_dir, elsewhere = tmp_path / "cfg", tmp_path / "elsewhere"
    elsewhere.mkdir()
    class_path = write_package(config_dir, name)
    config = config_dir / "bm.yaml"
    config.write_text(f"engine:\n  capacity_scheduler: {class_path}\n{more_yaml}")
    monkeypatch.chdir(elsewhere)
    return config


def test_a_module_beside_the_config_file_resolves_from_another_working_directory(
    tmp_path, monkeypatch, isolated_imports
):
    config = config_beside_package(tmp_path, monkeypatch, "bm_sched_beside")
    cfg = load_config(config)
    scheduler = build_scheduler(cfg.engine, kv_manager())
    assert type(scheduler.capacity_scheduler).__name__ == "CountingScheduler"


def test_a_module_in_the_working_directory_resolves_for_a_set_override(
    tmp_path, monkeypatch, isolated_imports
):
    class_path = write_package(tmp_path, "bm_sched_cwd")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, {"engine.capacity_scheduler": class_path})
    scheduler = build_scheduler(cfg.engine, kv_manager())
    assert type(scheduler.capacity_scheduler).__name__ == "CountingScheduler"


def test_a_module_found_nowhere_is_refused_when_the_config_loads_naming_where_it_looked(
    tmp_path, monkeypatch, isolated_imports
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError, match=r"engine\.scheduler: cannot import 'bm_sched_missing\.x:C' .*PYTHONPATH"
    ):
        load_config(None, {"engine.scheduler": "bm_sched_missing.x:C"})


def test_bm_run_uses_a_scheduler_named_beside_its_config(tmp_path, monkeypatch, isolated_imports):
    config = config_beside_package(tmp_path, monkeypatch, "bm_sched_run", "model:\n  device: cpu\n")
    elsewhere = tmp_path / "elsewhere"
    prompts = elsewhere / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"input_ids": [5, 6, 7], "max_tokens": 2}) + "\n" for _ in range(3))
    )
    result = runner.invoke(app, ["run", "p.jsonl", "-c", str(config), "-o", "out", "--quiet"])
    assert result.exit_code == 0, result.output
    assert sys.modules["bm_sched_run.policies"].CountingScheduler.plans > 0
    records = [json.loads(line) for line in (elsewhere / "out" / "outputs.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["error"] is None for r in records)


def test_loading_a_custom_scheduler_class_leaves_sys_path_unchanged(tmp_path, monkeypatch, isolated_imports):
    config = config_beside_package(tmp_path, monkeypatch, "bm_sched_path")
    before = list(sys.path)
    scheduler = build_scheduler(load_config(config).engine, kv_manager())
    assert type(scheduler.capacity_scheduler).__name__ == "CountingScheduler"
    assert sys.path == before
    assert sys.modules["bm_sched_path.policies"].__file__ == str(
        config.parent / "bm_sched_path" / "policies.py"
    )


def test_the_module_imports_its_package_siblings_relatively_and_by_name(
    tmp_path, monkeypatch, isolated_imports
):
    package = tmp_path / "bm_sched_sib"
    package.mkdir()  # no __init__.py: a namespace package, as examples/ is
    (package / "base.py").write_text(SCHEDULER_MODULE)
    (package / "helpers.py").write_text("PLANS_BEFORE = 0\n")
    (package / "policies.py").write_text(
        "from bm_sched_sib.helpers import PLANS_BEFORE\n"
        "from .base import CountingScheduler\n\n"
        "class SiblingScheduler(CountingScheduler):\n"
        "    plans = PLANS_BEFORE\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, {"engine.capacity_scheduler": "bm_sched_sib.policies:SiblingScheduler"})
    scheduler = build_scheduler(cfg.engine, kv_manager())
    assert type(scheduler.capacity_scheduler).__name__ == "SiblingScheduler"


def test_only_the_named_module_becomes_importable_not_the_rest_of_its_folder(
    tmp_path, monkeypatch, isolated_imports
):
    class_path = write_package(tmp_path, "bm_sched_named")
    (tmp_path / "bm_sched_stray.py").write_text("")
    monkeypatch.chdir(tmp_path)
    build_scheduler(load_config(None, {"engine.capacity_scheduler": class_path}).engine, kv_manager())
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("bm_sched_stray")


def test_a_package_on_pythons_path_wins_over_one_beside_the_config(tmp_path, monkeypatch, isolated_imports):
    installed, config_dir = tmp_path / "site", tmp_path / "cfg"
    class_path = write_package(installed, "bm_sched_both")
    write_package(config_dir, "bm_sched_both")
    monkeypatch.syspath_prepend(str(installed))
    config = config_dir / "bm.yaml"
    config.write_text(f"engine:\n  capacity_scheduler: {class_path}\n")
    build_scheduler(load_config(config).engine, kv_manager())
    assert sys.modules["bm_sched_both.policies"].__file__ == str(installed / "bm_sched_both" / "policies.py")

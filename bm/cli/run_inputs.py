"""What ``bm run`` checks and reads before the model loads: the config from the file, ``--set`` and the
flags, the chat template, the tool-call parser, the output directory and its lock, the run seed, a
``--resume``'s identity, and the request lines (an OpenAI batch file routed by served names, its unknown
body fields said once per name). Apart from the command's flags (:mod:`bm.cli.main`) so that the
command stays a list of options and an order of steps; everything here runs in seconds, without torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from bm.config import BmConfig, ConfigError, load_config, model_override, parse_override
from bm.runfiles.source import PromptsSource


def build_config(
    config: Path | None,
    overrides: list[str],
    model: str | None,
    model_config: str | None,
    served_model_name: list[str] | None = None,
    lora_modules: list[str] | None = None,
    generation_config: str | None = None,
) -> BmConfig:
    """The run's config: the YAML file, then ``--set``, then the flags that name a config key (each
    checked by that key's one check, so a flag and its key are refused in the same words)."""
    pairs = dict(parse_override(o) for o in overrides)
    if model:
        key, value = model_override(model)
        pairs[key] = value
    if model_config:
        pairs["model.config"] = model_config
    if served_model_name:
        pairs["model.served_model_name"] = list(served_model_name)
    if lora_modules:
        pairs["model.lora_modules"] = lora_module_pairs(lora_modules)
    if generation_config:
        pairs["model.generation_config"] = generation_config
    return load_config(config, pairs)


def lora_module_pairs(given: list[str]) -> dict[str, str]:
    """``--lora-modules NAME=DIR ...`` as the ``model.lora_modules`` mapping (vLLM's NAME=PATH form)."""
    modules: dict[str, str] = {}
    for text in given:
        name, sep, directory = text.partition("=")
        if not sep or not name or not directory:
            raise ConfigError(
                f"--lora-modules {text!r}: expected NAME=DIR, e.g. --lora-modules sql=./sql-lora"
            )
        if name in modules:
            raise ConfigError(f"--lora-modules: the name {name!r} is given twice; name each adapter once")
        modules[name] = directory
    return modules


def read_template(path: Path | None) -> str | None:
    """``--chat-template``'s text, read now so that a missing or unreadable file stops the run before
    the load (None: the tokenizer's own template)."""
    if path is None:
        return None
    from bm.runfiles.chat import read_chat_template

    return read_chat_template(path)


def check_tool_call_parser(name: str | None) -> None:
    """``--tool-call-parser`` refused before the load when bm has no parser of that name."""
    from bm.workloads.tool_parsers import check_parser

    check_parser(name)


def prepare_run_out_dir(
    out: Path, resume: bool, overwrite: bool, source: PromptsSource, max_tokens: int
) -> None:
    """-o checked and locked, with room for the run's records (bm.runfiles.diskspace), before the model
    loads."""
    from bm.runfiles.diskspace import run_output_bytes
    from bm.runfiles.outdir import prepare_out_dir

    needed = run_output_bytes(source.path, max_tokens, out, resume)
    prepare_out_dir(
        out, resume=resume, overwrite=overwrite, prompts=source.path, prompts_name=source.name, needed=needed
    )


def run_seed_of(out: Path, given: int | None, resume: bool) -> int | None:
    """The run's seed: ``--seed``, or on ``--resume`` the one the records were written with, so that a
    resumed run samples as the first one did (bm.runfiles.identity)."""
    from bm.runfiles.identity import run_seed_for

    return run_seed_for(out, given, resume)


def check_resume(
    out: Path,
    source: PromptsSource,
    cfg: BmConfig,
    max_tokens: int,
    ignore_eos: bool,
    template: str | None,
    run_seed: int | None = None,
    tool_call_parser: str | None = None,
    ray: bool = False,
) -> None:
    """``--resume`` into records of another model, config, run options or run seed is refused
    (docs/resume.md), and so is a resume that changes whether the run goes on Ray."""
    from bm.runfiles.identity import (
        check_resume_mode,
        check_run_identity,
        run_identity,
        run_options,
        saved_identity,
    )

    check_resume_mode(out, ray)
    options = run_options(max_tokens, ignore_eos, template, tool_call_parser)
    identity = run_identity(source.path, cfg, options, run_seed, name=source.name, known=saved_identity(out))
    check_run_identity(out, identity)


# Said once per run: a batch file written for a real model gets noise from the embedded one, and its
# responses name a model the file never asked for.
EMBEDDED_NOTE = (
    "no --model given: the batch file is answered by bm's embedded random-weight tiny model (its text is "
    "noise); give --model DIR (or a preset, or a cached hub id org/name)"
)


def read_requests(prompts: Path, cfg: BmConfig) -> tuple[Iterable, dict | None]:
    """The parsed lines, read as the run asks for them, and for an OpenAI batch file a dict that holds each
    line's :class:`~bm.runfiles.openai_batch.BatchLine` from when it is read until its output line is written
    (``None`` for bm's own format). A batch line's ``body.model`` is routed by ``cfg``'s served names and
    adapters (:class:`~bm.runfiles.served_models.ServedModels`)."""
    from bm.runfiles.openai_batch import IgnoredFieldNotices, is_batch_file, iter_batch_file
    from bm.runfiles.served_models import ServedModels
    from bm.workloads.jsonl import iter_request_file

    if not is_batch_file(prompts):
        return iter_request_file(prompts), None
    open_lines: dict = {}
    served = ServedModels.of(cfg.model)

    notices = IgnoredFieldNotices()

    def rows() -> Iterator:
        for line in iter_batch_file(prompts, served):
            notices.note(line)  # once per name, not per line
            open_lines[line.parsed.index] = line
            yield line.parsed

    return rows(), open_lines

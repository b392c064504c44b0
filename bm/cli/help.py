"""``--help`` that reads at 80 columns, and ``-q`` that silences the libraries' progress bars.

typer prints every name of an option in one column (``--dataset-kind,--dataset-name``) and a flag's
``--no-`` form in another, so on an 80-column terminal the names were cut (``--dataset-kind,--datas…``).
:class:`CompactHelp` renders each option under its first long name only; the other names keep working
and are listed in the option's help text, and the ``--no-`` forms are mentioned once below the panels.
It changes only what ``--help`` prints, never what a command accepts.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

from rich.markup import escape
from typer.core import TyperCommand

from bm.cli.vllm_flags import translate_vllm_flags, vllm_note

# bm run's options by panel (bench and compare declare theirs with rich_help_panel in place).
RUN_PANELS = {
    "model": "Model and engine",
    "model_config": "Model and engine",
    "set_": "Model and engine",
    "served_model_name": "Generation",
    "lora_modules": "Generation",
    "max_tokens": "Generation",
    "ignore_eos": "Generation",
    "chat_template": "Generation",
    "tool_call_parser": "Generation",
    "out_dir": "Output",
    "resume": "Output",
    "overwrite": "Output",
    "quiet": "Output",
    "show": "Output",
    "data_parallel": "Processes",
    "tensor_parallel": "Processes",
    "rank_timeout": "Processes",
    "ray": "Processes",
    "replicas": "Processes",
    "replica_threads": "Processes",
    "block_lines": "Processes",
    "ray_tries": "Processes",
}
NEGATIVE_NOTE = "An on/off flag also takes --no-FLAG (e.g. --no-ignore-eos) to undo a config file's true."


class CompactHelp(TyperCommand):
    """A typer command whose ``--help`` shows one name per option (see the module docstring)."""

    _compact = False

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        """vLLM's flags become the bm options they mean before click reads them (bm.cli.vllm_flags)."""
        return super().parse_args(ctx, translate_vllm_flags(args, self.name or "", self._option_names()))

    def _option_names(self) -> set[str]:
        return {
            name for p in self.params for name in (*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ()))
        }

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        return [compact_option(p) for p in params] if self._compact else params

    def format_help(self, ctx: Any, formatter: Any) -> None:
        original_epilog = self.epilog
        notes = [original_epilog] if original_epilog else []
        if any(_is_flag(p) and p.secondary_opts for p in self.params):
            notes.append(NEGATIVE_NOTE)
        vllm = vllm_note(self._option_names())
        if vllm:
            notes.append(vllm)
        # escaped: rich markup would eat "[len*(1-r), len*(1+r)]" from a config key's description
        self.epilog = escape("\n\n".join(notes)) if notes else None
        self._compact = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._compact, self.epilog = False, original_epilog


def _is_flag(param: Any) -> bool:
    return param.param_type_name == "option" and bool(getattr(param, "is_flag", False))


def compact_option(param: Any) -> Any:
    """A display copy of ``param`` (an option of typer's click): its first long name (and short ones),
    other names in the help, no ``--no-`` column, no ``<bool>`` type for a flag, and a panel for
    ``bm run``'s options. Arguments come back as they are."""
    if param.param_type_name != "option":
        return param
    longs = [name for name in param.opts if name.startswith("--")]
    shorts = [name for name in param.opts if not name.startswith("--")]
    shown: Any = copy.copy(param)
    shown.opts = longs[:1] + shorts
    shown.secondary_opts = []
    if len(longs) > 1:
        also = ", ".join(longs[1:])
        shown.help = f"{param.help} Also {also}." if param.help else f"Also {also}."
    if shown.help:  # rich markup would eat "[bm-out/run-TIME]"
        shown.help = escape(shown.help)
    if _is_flag(param):
        shown.metavar = ""
    if getattr(shown, "rich_help_panel", None) is None and param.name in RUN_PANELS:
        shown.rich_help_panel = RUN_PANELS[param.name]
    return shown


def silence_progress_bars() -> None:
    """``-q``: no progress bars from transformers or huggingface_hub (the "Loading weights" bar a
    checkpoint load prints), whether or not they are imported yet. Warnings and errors still print."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when huggingface_hub is first imported
    if "transformers" in sys.modules:
        from transformers.utils import logging

        logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()

"""vLLM's engine flags on bm's commands: mapped onto bm's config keys where bm has the same knob, and
refused with the bm equivalent named where it has none.

A vLLM user types ``--max-model-len 4096`` from habit. click alone would refuse it and suggest the
closest spelling (``--max-tokens``), which is another knob entirely. So before click parses, each vLLM
flag is rewritten into the bm option it means (``--set engine.max_seq_len=4096``); the value is then
judged by the config's own checks like any ``--set``, so there is no second validation of it here.
A vLLM flag bm cannot honour stops the command with a line that names what to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import typer

from bm.config.vllm import ENFORCE_EAGER_KEY, VLLM_ENGINE_KEYS, VLLM_SWITCHES, VLLM_UNSUPPORTED

# typer ships its own click; its usage error (exit 2, printed to stderr with the usage line) is the one
# base of typer.BadParameter, which typer exports.
UsageError: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag: the bm option it becomes (``--set`` with ``key``, or a bm flag of its own), and
    the value a switch (a flag that takes no value) sets."""

    key: str | None = None  # the config key, set through --set KEY=VALUE
    option: str | None = None  # or the bm option the value goes to
    switch: str | None = None  # a switch: the value it sets; None: the flag takes a value

    def target(self) -> str:
        return self.key if self.key is not None else str(self.option)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# vLLM flag -> what it means in bm, from the one table bm.LLM's keywords use (bm.config.vllm). Keys are
# checked against bm.config by a test.
VLLM_FLAGS: dict[str, VllmFlag] = {
    **{_flag(n): VllmFlag(key=k) for n, k in VLLM_ENGINE_KEYS.items() if n not in VLLM_SWITCHES},
    **{_flag(n): VllmFlag(key=VLLM_ENGINE_KEYS[n], switch="true") for n in VLLM_SWITCHES},
    **{"--no-" + _flag(n)[2:]: VllmFlag(key=VLLM_ENGINE_KEYS[n], switch="false") for n in VLLM_SWITCHES},
    "--enforce-eager": VllmFlag(key=ENFORCE_EAGER_KEY, switch="off"),
    "--tensor-parallel-size": VllmFlag(option="--tensor-parallel"),
    "-tp": VllmFlag(option="--tensor-parallel"),
    "--data-parallel-size": VllmFlag(option="--data-parallel"),
    "-dp": VllmFlag(option="--data-parallel"),
}

# vLLM flags with no bm counterpart -> what to do instead (the table bm.LLM's keywords use too).
VLLM_HINTS: dict[str, str] = {_flag(n): f"{u.why}; {u.flag}" for n, u in VLLM_UNSUPPORTED.items()}
VLLM_HINTS["-pp"] = VLLM_HINTS["--pipeline-parallel-size"]


def translate_vllm_flags(args: list[str], command: str, options: set[str]) -> list[str]:
    """``args`` with every vLLM flag of :data:`VLLM_FLAGS` replaced by the bm option it means.

    ``options`` are the option names ``command`` takes: a vLLM flag whose bm option the command lacks
    (``-dp`` on ``bm compare``) and every flag of :data:`VLLM_HINTS` raise a :class:`UsageError`
    naming the bm equivalent. Nothing after ``--`` is touched."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return out + args[i:]
        name, eq, inline = arg.partition("=")
        if name in VLLM_HINTS:
            raise UsageError(f"{name} is vLLM's; {VLLM_HINTS[name]}")
        flag = VLLM_FLAGS.get(name)
        if flag is None:
            out.append(arg)
            i += 1
            continue
        if flag.switch is not None:
            if eq:
                raise UsageError(f"{name} (vLLM's) takes no value; it sets {flag.key}={flag.switch}")
            value, i = flag.switch, i + 1
        elif eq:
            value, i = inline, i + 1
        elif i + 1 < len(args):
            value, i = args[i + 1], i + 2
        else:
            raise UsageError(f"{name} needs a value (it sets {flag.target()})")
        if flag.key is not None:
            out += ["--set", f"{flag.key}={value}"]
        elif flag.option in options:
            out += [str(flag.option), value]
        else:
            raise UsageError(f"{name} (vLLM's) means {flag.option}, which bm {command} does not take")
    return out


def vllm_note(options: set[str]) -> str:
    """The help's line on the vLLM flags ``options`` (a command's option names) can take."""
    if "--set" not in options:
        return ""
    names: dict[str, list[str]] = {}  # target -> the vLLM spellings of it (-tp beside --tensor-parallel-size)
    for name, flag in VLLM_FLAGS.items():
        if not name.startswith("--no-") and (flag.key is not None or flag.option in options):
            names.setdefault(flag.target(), []).append(name)
    listed = [f"{'/'.join(spellings)} ({target})" for target, spellings in names.items()]
    return "vLLM's flags set bm's keys: " + ", ".join(listed) + "."

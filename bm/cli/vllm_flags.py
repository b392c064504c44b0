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
from pathlib import Path

import typer

from bm.config.vllm import ENFORCE_EAGER_KEY, VLLM_ENGINE_KEYS, VLLM_SWITCHES, VLLM_UNSUPPORTED

# typer ships its own click; its usage error (exit 2, printed to stderr with the usage line) is the one
# base of typer.BadParameter, which typer exports.
UsageError: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM (or trtllm-bench) flag: the bm option it becomes (``--set`` with ``key``, or a bm flag of
    its own), and the value a switch (a flag that takes no value) sets."""

    key: str | None = None  # the config key, set through --set KEY=VALUE
    option: str | None = None  # or the bm option the value goes to (a switch: the bm switch it becomes)
    switch: str | None = None  # a switch: the value it sets; None: the flag takes a value
    drop: bool = False  # a switch bm needs no flag for: it does that anyway (results.json is always written)
    words: bool = False  # takes every following METRIC:VALUE word, as vLLM's --goodput ttft:500 tpot:50 does
    owner: str = "vLLM"

    def target(self) -> str:
        if self.drop:
            return "nothing (bm always does what it asks)"
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

# The flags of `vllm bench serve` / `vllm bench throughput` and of `trtllm-bench throughput` that bm's
# benchmark options spell differently (the ones spelled alike, --num-prompts, --request-rate,
# --max-concurrency, --dataset-name, --seed, --burstiness, --input-len, --concurrency, --warmup, are bm's own
# options or their aliases; --dataset-path and trtllm's --dataset are DATASET's). A pasted command runs, or
# stops on the first flag bm cannot honour with what to use instead. docs/bench.md lists them.
BENCH_FLAGS: dict[str, VllmFlag] = {
    "--random-input-len": VllmFlag(option="--input-len"),
    "--random-output-len": VllmFlag(option="--output-len"),
    "--random-range-ratio": VllmFlag(option="--range-ratio"),
    "--random-prefix-len": VllmFlag(option="--prefix-len"),
    "--custom-output-len": VllmFlag(option="--output-len"),  # rows that give no length (vLLM's custom)
    "--result-dir": VllmFlag(option="--out-dir"),
    "--goodput": VllmFlag(option="--slo", words=True),
    "--disable-tqdm": VllmFlag(option="--quiet", switch=""),
    "--save-result": VllmFlag(switch="", drop=True),  # results.json is always written
    "--save-detailed": VllmFlag(switch="", drop=True),  # requests.jsonl is always written
    "--disable-detokenize": VllmFlag(switch="", drop=True),  # bm bench never decodes its outputs
    "--num_requests": VllmFlag(option="--num-requests", owner="trtllm-bench"),
    "--max_batch_size": VllmFlag(key="engine.max_batch_size", owner="trtllm-bench"),
    "--max_num_tokens": VllmFlag(key="engine.max_num_tokens", owner="trtllm-bench"),
    "--kv_cache_free_gpu_mem_fraction": VllmFlag(key="kv_cache.free_memory_fraction", owner="trtllm-bench"),
    "--model_path": VllmFlag(option="--model", owner="trtllm-bench"),
    "--streaming": VllmFlag(switch="", drop=True, owner="trtllm-bench"),  # every bench request streams
}
_IN_PROCESS = "bm bench runs its engine in this process, with no server: drop it"
_REPORT = (
    "bm writes its report to OUT_DIR/results.json beside requests.jsonl and stats.jsonl: give the "
    "directory with -o DIR (docs/bench.md maps the report's keys to vLLM's and trtllm-bench's)"
)
# Benchmark flags bm has no counterpart for -> (whose flag, what to do instead).
BENCH_HINTS: dict[str, tuple[str, str]] = {
    "--backend": (
        "vLLM's",
        "bm bench measures bm's own engine; drop it (bm compare --baselines hf-generate,hf-cb "
        "measures transformers beside it)",
    ),
    **{name: ("vLLM's", _IN_PROCESS) for name in ("--base-url", "--host", "--port", "--endpoint")},
    "--served-model-name": ("vLLM's", _IN_PROCESS),
    "--result-filename": ("vLLM's", _REPORT),
    "--output-json": ("vLLM's", _REPORT),
    "--report_json": ("trtllm-bench's", _REPORT),
    "--iteration_log": (
        "trtllm-bench's",
        "bm writes every iteration's stats to OUT_DIR/stats.jsonl (-o DIR)",
    ),
    "--sharegpt-output-len": (
        "vLLM's",
        "bm takes each ShareGPT row's output length from its second turn: cap them with --max-output-len N "
        "or scale them with --output-scale X",
    ),
    "--extra_llm_api_options": (
        "trtllm-bench's",
        "give bm's engine settings in a -c CONFIG.yaml or with --set",
    ),
    "--pp": ("trtllm-bench's", VLLM_HINTS["--pipeline-parallel-size"]),
}


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
        if name in LIST_OPTIONS and name in options and not eq:  # vLLM's `--lora-modules a=X b=Y`
            values, i = _list_values(args, i + 1, LIST_OPTIONS[name])
            out += [w for value in values for w in (name, value)] if values else [name]  # none: click says so
            continue
        if name in options:  # the command's own option: never read as another tool's
            out.append(arg)
            i += 1
            continue
        if name in VLLM_HINTS:
            raise UsageError(f"{name} is vLLM's; {VLLM_HINTS[name]}")
        if name in BENCH_HINTS:
            owner, hint = BENCH_HINTS[name]
            raise UsageError(f"{name} is {owner}; {hint}")
        flag = VLLM_FLAGS.get(name) or BENCH_FLAGS.get(name)
        if flag is None:
            out.append(arg)
            i += 1
            continue
        if flag.drop and "--num-requests" not in options:  # a benchmark's flag, not this command's
            raise UsageError(f"{name} is {flag.owner}'s benchmark flag, which bm {command} does not take")
        if flag.option is not None and flag.option not in options:
            raise UsageError(f"{name} ({flag.owner}'s) means {flag.option}, which bm {command} does not take")
        if flag.words:
            values, i = _words(name, inline if eq else None, args, i + 1, flag)
            for value in values:
                out += [str(flag.option), value]
            continue
        if flag.switch is not None:
            if eq:
                raise UsageError(f"{name} ({flag.owner}'s) takes no value; it sets {_switch_target(flag)}")
            value, i = flag.switch, i + 1
        elif eq:
            value, i = inline, i + 1
        elif i + 1 < len(args):
            value, i = args[i + 1], i + 2
        else:
            raise UsageError(f"{name} needs a value (it sets {flag.target()})")
        if flag.drop:
            continue
        if flag.key is not None:
            out += ["--set", f"{flag.key}={value}"]
        else:
            out += [str(flag.option)] + ([value] if flag.switch is None else [])
    return out


# bm's repeatable options that vLLM writes as one flag followed by several values -> how to tell one of its
# values from the next argument: a NAME=PATH word; a served name is any word that is not an option and not
# an existing file (the prompts file bm run takes may follow the names).
LIST_OPTIONS: dict[str, str] = {"--lora-modules": "pairs", "--served-model-name": "names"}


def _list_values(args: list[str], i: int, kind: str) -> tuple[list[str], int]:
    """The values after a list option at ``args[i - 1]`` (at least one, as click would ask), and where the
    rest begins."""
    values: list[str] = []
    while i < len(args) and not args[i].startswith("-"):
        word = args[i]
        belongs = "=" in word if kind == "pairs" else not (values and Path(word).exists())
        if not belongs:
            break
        values.append(word)
        i += 1
    if not values and i < len(args):  # let click judge the one value it expects
        values, i = [args[i]], i + 1
    return values, i


def _switch_target(flag: VllmFlag) -> str:
    if flag.drop:
        return "nothing (bm always does what it asks)"
    return f"{flag.key}={flag.switch}" if flag.key is not None else flag.target()


def _words(name: str, inline: str | None, args: list[str], i: int, flag: VllmFlag) -> tuple[list[str], int]:
    """The METRIC:VALUE words after ``name`` (``--goodput ttft:500 tpot:50``), and where the rest begins."""
    words = [inline] if inline is not None else []
    while i < len(args) and not args[i].startswith("-") and ":" in args[i]:
        words.append(args[i])
        i += 1
    if not words:
        raise UsageError(
            f"{name} needs METRIC:MS words, e.g. {name} ttft:500 tpot:50 (it sets {flag.option})"
        )
    return words, i


def vllm_note(options: set[str]) -> str:
    """The help's line on the vLLM flags ``options`` (a command's option names) can take."""
    if "--set" not in options:
        return ""
    names: dict[str, list[str]] = {}  # target -> the vLLM spellings of it (-tp beside --tensor-parallel-size)
    for name, flag in VLLM_FLAGS.items():
        if not name.startswith("--no-") and (flag.key is not None or flag.option in options):
            names.setdefault(flag.target(), []).append(name)
    listed = [f"{'/'.join(spellings)} ({target})" for target, spellings in names.items()]
    note = "vLLM's flags set bm's keys: " + ", ".join(listed) + "."
    if "--num-requests" in options:
        note += " vllm bench's and trtllm-bench's own flags are taken too (docs/bench.md)."
    return note

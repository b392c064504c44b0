"""The YAML configuration: sections ``model``, ``engine``, ``kv_cache``, ``peft_cache``, ``bench``, ``sim``
and ``sweep``, validated up front.

Every knob is declared once, as a dataclass field with its help text and its check (:mod:`.fields`), so
the loader, the ``--set`` overrides and the ``bm run --help`` reference all read the same declaration. A
bad file never half-applies: the first problem raises :class:`ConfigError` naming the dotted key and what
is allowed. The package is plain Python (no torch) so the scheduler simulation and the CLI can use it
cheaply.

One module per responsibility: :mod:`.fields` (declaring a knob, the shared checks), one module per
section (:mod:`.model`, :mod:`.engine`, :mod:`.kv`, :mod:`.bench`, :mod:`.sim`), :mod:`.sections` (the
whole :class:`BmConfig`, its cross-section checks, per-device resolution and the reference),
:mod:`.loading` (files and ``--set`` overrides) and :mod:`.classpath` (custom scheduler classes). Import
from ``bm.config``; the modules are how it is kept, not an interface.
"""

from bm.config.bench import DATASET_KINDS, BenchConfig
from bm.config.classpath import CLASS_KEYS, find_class_module
from bm.config.engine import (
    BATCHING_SCHEMES,
    CHUNKING_POLICIES,
    ENGINE_DEFAULTS,
    SCHEDULER_POLICIES,
    BatchingScheme,
    ContextChunkingPolicy,
    EngineConfig,
    SchedulerPolicy,
    engine_defaults,
)
from bm.config.fields import ConfigError
from bm.config.kv import KvCacheConfig, PeftCacheConfig
from bm.config.loading import load_config, parse_override
from bm.config.model import DTYPES, MODEL_PRESETS, ModelConfig, model_override, resolve_dtype_name
from bm.config.sections import (
    REPO_ROOT,
    SECTIONS,
    BmConfig,
    config_from_dict,
    config_reference,
    resolve_engine,
    validate,
    validate_budgets,
)
from bm.config.sim import SimConfig, SweepConfig

__all__ = [
    "BATCHING_SCHEMES",
    "CHUNKING_POLICIES",
    "CLASS_KEYS",
    "DATASET_KINDS",
    "DTYPES",
    "ENGINE_DEFAULTS",
    "MODEL_PRESETS",
    "REPO_ROOT",
    "SCHEDULER_POLICIES",
    "SECTIONS",
    "BatchingScheme",
    "BenchConfig",
    "BmConfig",
    "ConfigError",
    "ContextChunkingPolicy",
    "EngineConfig",
    "KvCacheConfig",
    "ModelConfig",
    "PeftCacheConfig",
    "SchedulerPolicy",
    "SimConfig",
    "SweepConfig",
    "config_from_dict",
    "config_reference",
    "engine_defaults",
    "find_class_module",
    "load_config",
    "model_override",
    "parse_override",
    "resolve_dtype_name",
    "resolve_engine",
    "validate",
    "validate_budgets",
]

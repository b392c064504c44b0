"""Which variants a comparison runs, decided from names alone (no torch), so a typo in ``--schemes``,
``--policies`` or ``--baselines`` is reported before any model loads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bm.config import BATCHING_SCHEMES, SCHEDULER_POLICIES, BmConfig, ConfigError, config_from_dict

BASELINES = ("hf-generate", "hf-cb")


@dataclass(frozen=True)
class Variant:
    """One column of the comparison: a bm scheme/policy pair, or a reference baseline."""

    name: str
    kind: str  # "bm" or "baseline"
    scheme: str | None = None
    policy: str | None = None


def _names(text: str | Sequence[str], option: str) -> list[str]:
    items = text.split(",") if isinstance(text, str) else list(text)
    names = [i.strip() for i in items if i.strip()]
    if len(set(names)) != len(names):
        raise ConfigError(f"{option}: {', '.join(names)} lists a name twice")
    return names


def plan_variants(
    schemes: str | Sequence[str], policies: str | Sequence[str], baselines: str | Sequence[str] = ()
) -> list[Variant]:
    """Every scheme x policy pair, then the baselines. A variant is named by its scheme alone when one
    policy is compared, else ``scheme:policy`` (the names the --assert expressions use)."""
    scheme_names, policy_names = _names(schemes, "--schemes"), _names(policies, "--policies")
    if not scheme_names:
        raise ConfigError("--schemes: name at least one of v1, inflight, inflight_fused")
    if not policy_names:
        raise ConfigError("--policies: name at least one of " + ", ".join(SCHEDULER_POLICIES))
    resolved_schemes = [_resolve(s, BATCHING_SCHEMES, "--schemes") for s in scheme_names]
    resolved_policies = [_resolve(p, SCHEDULER_POLICIES, "--policies") for p in policy_names]
    variants = []
    for scheme in dict.fromkeys(resolved_schemes):
        for policy in dict.fromkeys(resolved_policies):
            name = scheme if len(resolved_policies) == 1 else f"{scheme}:{policy}"
            variants.append(Variant(name, "bm", scheme, policy))
    for baseline in _names(baselines, "--baselines"):
        if baseline not in BASELINES:
            raise ConfigError(
                f"--baselines: unknown baseline {baseline!r}; choose from {', '.join(BASELINES)}"
            )
        variants.append(Variant(baseline, "baseline"))
    return variants


def check_baselines_eos(variants: Sequence[Variant], ignore_eos: bool) -> None:
    """The HF baselines run every row to its full length (their EOS is switched off, bm.baselines): beside
    bm variants that stop at EOS (``--respect-eos``) the table would compare unequal work, so the pair is
    refused before anything loads."""
    baselines = [v.name for v in variants if v.kind == "baseline"]
    if baselines and not ignore_eos:
        raise ConfigError(
            f"--baselines {','.join(baselines)} run every row to its full length, but --respect-eos stops "
            "bm's variants at EOS, so they would do less work than the baselines; drop --respect-eos, "
            "or drop --baselines"
        )


def _resolve(name: str, aliases: Mapping[str, str], option: str) -> str:
    value = aliases.get(name.lower())
    if value is None:
        choices = ", ".join(dict.fromkeys(aliases.values()))
        raise ConfigError(f"{option}: unknown name {name!r}; choose from {choices}")
    return value


def variant_config(config: BmConfig, variant: Variant) -> BmConfig:
    data = config.to_dict()
    data["engine"]["batching_scheme"] = variant.scheme
    data["engine"]["scheduler_policy"] = variant.policy
    return config_from_dict(data)

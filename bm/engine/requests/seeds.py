"""Seeds derived from seeds: one request's samples, one run's unseeded lines.

A derived seed is a pure function of its parent seed and a key (a sample's index, a line's index), so a
sample does not depend on its siblings or the batch, and a run is reproducible from its run seed alone.
Plain Python (no torch).
"""

from __future__ import annotations

import hashlib
import secrets

UINT64_MAX = 2**64 - 1


def derive_seed(seed: int, *keys: int | str) -> int:
    """A uint64 seed for ``keys`` under ``seed`` (a sha256 of both: unrelated keys give unrelated
    streams, and the same pair always gives the same seed, on any machine)."""
    text = repr((int(seed), *keys)).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little")


def sample_seed(request_seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of a request: sample 0 keeps the request's own seed (so ``n: 1``
    samples exactly as before), the others get one derived from it."""
    return request_seed if sample_index == 0 else derive_seed(request_seed, "sample", sample_index)


def line_seed(run_seed: int, line_index: int) -> int:
    """The seed of an unseeded line of a run (``bm run``/``bm bench``): derived from the run seed and the
    line's 0-based index, so duplicate lines differ and ``--seed`` reproduces the run."""
    return derive_seed(run_seed, "line", line_index)


def random_run_seed() -> int:
    """A fresh run seed when ``--seed`` is not given (recorded in run.json so ``--resume`` reuses it)."""
    return secrets.randbits(63)

"""``bm run --ray``: independent engine replicas as Ray actors over Ray Data blocks of a prompts file,
on one machine or many (docs/parallel.md). Needs the ``ray`` extra (``pip install 'bm[ray]'``); nothing
else in bm imports Ray.

The library's entry point is :func:`run_batch`, ``bm run --ray`` as a call.
"""

from __future__ import annotations

from bm.ray.api import run_batch

__all__ = ["run_batch"]

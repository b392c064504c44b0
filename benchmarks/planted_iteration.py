"""Run a bm command with a planted scheduler regression: every request takes one more iteration.

    python benchmarks/planted_iteration.py compare --executor sim ... --baseline PREV/compare.json

is ``bm compare ...`` with the micro-batch stage holding back the last block of every prompt longer than
one block: a context that would finish in one iteration computes all but its last ``unit`` tokens (a
whole KV block) first and the rest in the next iteration, as a scheduler bug that chunks too eagerly
would. No token changes and every prompt token is still computed once; each request just takes one more
iteration to reach its first token, so the simulator's TTFT, E2EL and throughput get worse and
``num_iterations`` grows. It is how the simulator gate (``bm compare --executor sim --baseline``) is shown
to catch a scheduler regression exactly (tests/test_compare_sim_gate.py, docs/compare.md); nothing in
``bm`` knows about it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any

from bm.scheduling.micro_batch import MicroBatchScheduler


def _held_back(schedule: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(schedule)
    def run(self: MicroBatchScheduler, fitting: Any, *args: Any, **kwargs: Any) -> Any:
        contexts, generation = schedule(self, fitting, *args, **kwargs)
        unit = self.chunking.unit
        for request in contexts:
            chunk = self.chunk_sizes[request.request_id]
            start = request.num_computed_tokens
            # a context's whole remainder in one chunk, from its start: leave its last block for later
            if start == 0 and chunk == request.num_tokens and chunk > unit:
                self.chunk_sizes[request.request_id] = (chunk - 1) // unit * unit
        return contexts, generation

    return run


@contextmanager
def planted_extra_iteration() -> Iterator[None]:
    """Within the block every prompt longer than one KV block takes one more iteration (module doc);
    the class is restored on leaving."""
    saved = MicroBatchScheduler.schedule
    MicroBatchScheduler.schedule = _held_back(saved)  # type: ignore[method-assign]
    try:
        yield
    finally:
        MicroBatchScheduler.schedule = saved  # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    """``BM-ARGS...``: run ``bm BM-ARGS`` with the regression planted; returns bm's exit code."""
    if not argv:
        print(
            "usage: planted_iteration.py BM-COMMAND [ARGS...]  (e.g. compare --executor sim ...)",
            file=sys.stderr,
        )
        return 2
    from bm.cli.main import app

    with planted_extra_iteration():
        try:
            app(argv, prog_name="bm")
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

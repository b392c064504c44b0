"""Every table bm prints goes through :func:`print_table`, so no figure is ever cut.

rich fits a table to the console and ends a cell that does not fit with an ellipsis: ``41,048.…`` in a
CI log, or two sweep configurations that both read ``inflight…``. A figure cut short is worse than none.
So off a terminal (a pipe, a file, a CI log: nobody's window to fit) a table prints at its natural width,
however wide; on a terminal a cell too narrow wraps its characters onto the next line instead of
dropping them.
"""

from __future__ import annotations

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

UNBOUNDED = 10_000  # columns: wider than any table bm prints


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` whole: at its natural width off a terminal, folded (never cut) on one."""
    for column in table.columns:
        column.overflow = "fold"
    if not console.is_terminal:
        natural = Measurement.get(console, console.options.update_width(UNBOUNDED), table).maximum
        if natural > console.width:
            table.width = natural
            console.print(table, crop=False)
            return
    console.print(table)

"""How long a test waits for what the code under test makes happen before it calls it a hang.

Not a timing assertion: a test waits on an event (a record written, a process ended, a file made), and
this bound only keeps a real hang from blocking the suite for ever. It is far beyond what any run in
the suite takes on a loaded machine (on 2 shared cores with busy loops beside them, the slowest single
wait measured a few minutes), so a slow machine never fails a test; only a hang does.
"""

HANG_S = 1200.0

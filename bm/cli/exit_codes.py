"""The exit codes of ``bm run``, ``bm bench`` and ``bm compare``, decided in one place (see docs/exit-codes.md).

A script driving bm needs to tell three outcomes apart without parsing the output: the run did its job
(records for every line; some requests may have failed, each with its error in its record, as an
OpenAI batch reports failed lines in its output), the input was refused before anything ran, and the
run went through but produced nothing usable. The last used to exit 0: ``bm bench`` on a file whose 12
rows all failed looked like a success to CI.
"""

from __future__ import annotations

OK = 0  # every request succeeded, or at least one did and the failed ones carry their error
FAILED = 1  # the run broke off (a rank died or hung), bm compare's gate failed, or a traceback (a bug)
USAGE = 2  # refused before running: a flag, the config, an input file, the model or -o
NO_SUCCESS = 3  # it ran, but no request succeeded: every record is an error
# bm compare --baseline could not judge a timing (the pairs too noisy to place against the tolerance, or
# no quiet repeat against saved timings) before --time-limit or --max-repeat: not a pass, not a failure
# of the code; --allow-unjudged turns it into 0
NOT_JUDGED = 4
INTERRUPTED = 130  # Ctrl-C or SIGTERM (128 + SIGINT, the shell's convention); --resume finishes it


def run_exit_code(num_requests: int, num_succeeded: int, interrupted: bool) -> int:
    """The code a finished ``bm run`` or ``bm bench`` exits with.

    ``num_succeeded`` counts requests that finished normally (length, end id or stop), records kept by
    ``--resume`` included; cancelled and failed ones are not successes. An interrupt wins: the user
    stopped the run, so how many succeeded says nothing about the input."""
    if interrupted:
        return INTERRUPTED
    if num_requests > 0 and num_succeeded == 0:
        return NO_SUCCESS
    return OK

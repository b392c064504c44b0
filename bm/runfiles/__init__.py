"""The files of a run, shared by ``bm run`` and ``bm run --ray`` (bm.ray): the input lines read
(prompts files, OpenAI batch files), the records written, the output directory and its lock, the run's
identity that ``--resume`` checks, and the summary counted from the records. No typer here and no
command: the terminal is bm.cli, above both."""

"""``python -m bm`` (and ``torchrun -m bm``): the same command line as ``bm``."""

from bm.cli.entry import main

main()

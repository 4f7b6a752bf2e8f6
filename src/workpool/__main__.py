"""``python -m workpool``: the command line."""

from workpool.cli import main

main()

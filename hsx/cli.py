"""The `hsx` entry point (`hsx ...`, `python -m hsx.cli ...`); the command line is commands/cli.py."""

import sys

from hsx.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())

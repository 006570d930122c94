"""The command `python -m lib.models build ...`: its name is part of every recorded 04-06
transcript's argv, so it stays; the code is lib.engines.models. Listed in lib/ALIASES.md."""
import sys

from lib.engines.models import main

if __name__ == "__main__":
    sys.exit(main())

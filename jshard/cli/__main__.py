"""`python -m jshard.cli ...`: the `jshard` command (what `jshard launch` runs in each process)."""

import sys

from jshard.cli import main

sys.exit(main())

"""`python -m infinity ...`: the `infinity` command, also as torchrun runs it (`-m infinity`)."""

import sys

from infinity.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

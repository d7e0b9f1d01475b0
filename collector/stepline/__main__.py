"""`python -m stepline`: the `stepline` command."""

import sys

from stepline.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

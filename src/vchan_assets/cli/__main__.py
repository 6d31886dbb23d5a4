"""`python -m vchan_assets.cli`: the `vchan` command."""

import sys

from vchan_assets.cli import main

if __name__ == "__main__":  # not when imported (tests walk every module of the package)
    sys.exit(main())

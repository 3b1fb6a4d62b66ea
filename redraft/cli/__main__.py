"""``python -m redraft.cli ...``: the same as the ``redraft`` command."""

import sys

from redraft.cli import main

if __name__ == "__main__":
    sys.exit(main())

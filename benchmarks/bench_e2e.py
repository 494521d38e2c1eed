"""Run the ``e2e`` suite; the same as ``kvstore bench e2e`` (try ``--help``, ``--quick``, ``--out DIR``).

The suite's code lives in ``kvstore/bench/e2e.py`` so the installed ``kvstore`` command has it too.
"""

import sys

from kvstore.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "e2e", *sys.argv[1:]]))

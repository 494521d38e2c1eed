"""Run the ``lookup`` suite; the same as ``kvstore bench lookup`` (try ``--help``, ``--quick``, ``--out DIR``).

The suite's code lives in ``kvstore/bench/lookup.py`` so the installed ``kvstore`` command has it too.
"""

import sys

from kvstore.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "lookup", *sys.argv[1:]]))

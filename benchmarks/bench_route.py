"""Run the ``route`` suite; the same as ``kvstore bench route`` (try ``--help``, ``--quick``, ``--out DIR``).

The suite's code lives in ``kvstore/bench/route.py`` so the installed ``kvstore`` command has it too.
"""

import sys

from kvstore.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "route", *sys.argv[1:]]))

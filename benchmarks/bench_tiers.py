"""Run the ``tiers`` suite; the same as ``kvstore bench tiers`` (try ``--help``, ``--quick``, ``--out DIR``).

The suite's code lives in ``kvstore/bench/tiers.py`` so the installed ``kvstore`` command has it too.
"""

import sys

from kvstore.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "tiers", *sys.argv[1:]]))

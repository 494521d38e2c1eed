"""Run the ``hitrate`` suite; the same as ``kvstore bench hitrate`` (try ``--help``, ``--quick``, ``--out DIR``).

The suite's code lives in ``kvstore/bench/hitrate.py`` so the installed ``kvstore`` command has it too.
"""

import sys

from kvstore.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "hitrate", *sys.argv[1:]]))

"""``python -m kvstore`` runs the command line."""

import sys

from kvstore.cli.main import main

sys.exit(main())

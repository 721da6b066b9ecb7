"""`python -m cluster.cli`: the `orchard` command."""

import sys

from cluster.cli.main import main

sys.exit(main())

"""`python -m orchard.cluster.cli`: the `orchard` command."""

import sys

from orchard.cluster.cli.main import main

sys.exit(main())

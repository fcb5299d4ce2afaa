"""``python -m swarmtrain.config [--check] [DOC]``: regenerate docs/config.md's key tables."""

import sys

from swarmtrain.config.docs import main

sys.exit(main(sys.argv[1:]))

import sys

from swarmtrain.cli import main

sys.exit(main())

import sys

from swarmtrain.app.cli import main

sys.exit(main())

import sys

from dgr.artifacts.manifest import main

sys.exit(main())

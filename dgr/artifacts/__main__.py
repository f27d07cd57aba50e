import sys

from dgr.artifacts.cli import main

sys.exit(main())

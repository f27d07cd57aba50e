import sys

from dgr.cli.commands import main

sys.exit(main())

import sys

from dgr.vendor.cli import main

sys.exit(main())

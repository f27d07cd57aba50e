import sys

from dgr.vendor import main

sys.exit(main())

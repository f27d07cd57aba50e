import sys

from dgr.worker.main import main

sys.exit(main())

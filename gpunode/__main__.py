"""`python -m gpunode`."""

import sys

from gpunode.cli.main import main

sys.exit(main())

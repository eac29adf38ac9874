"""`python -m grpokit ...` (also under torchrun): the same command line as `grpokit`."""

import sys

from grpokit.cli import main

sys.exit(main())

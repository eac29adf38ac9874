"""`python -m grpokit ...` (also under torchrun): the same command line as `grpokit`."""

import sys

from grpokit import distributed
from grpokit.cli import main

code = main()
if distributed.launched():  # torchrun's process: its group is destroyed; skip the interpreter's teardown
    distributed.leave(code)
sys.exit(code)

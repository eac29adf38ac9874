"""`python -m grpokit ...` (also under torchrun): the same command line as `grpokit`."""

from grpokit import distributed
from grpokit.cli import main

distributed.exit_process(main())

"""`python -m torch_mhc ...` is the `mhc` command."""

import sys

from torch_mhc.tools.cli import main

sys.exit(main())

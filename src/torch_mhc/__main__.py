"""`python -m torch_mhc ...` is the `mhc` command."""

import sys

from .cli import main

sys.exit(main())

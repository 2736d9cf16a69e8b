"""`torch_mhc.hf` is `torch_mhc.integrations.hf` (needs `pip install -e ".[hf]"`).

Kept as the short name users import; the same module object, so submodules and classes are
shared with the full path.
"""

import sys

from torch_mhc.integrations import hf as _hf

sys.modules[__name__] = _hf

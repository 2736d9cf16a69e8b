"""Remote-code templates of the reference LM as a Hugging Face model, for `mhc export-hf`.

configuration_torch_mhc_lm.py and modeling_torch_mhc_lm.py are copied as they are into an
exported folder, beside copies of torch_mhc/functional/{sinkhorn,maps,successors}.py (the
maths, imported relatively there); they run only from such a folder, with torch and
transformers and without torch_mhc. Nothing in the package imports them.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["FUNCTIONAL_FILES", "TEMPLATE_DIR", "TEMPLATE_FILES"]

TEMPLATE_DIR = Path(__file__).resolve().parent
TEMPLATE_FILES = ("configuration_torch_mhc_lm.py", "modeling_torch_mhc_lm.py")
# the maths the modeling file imports, from torch_mhc/functional
FUNCTIONAL_FILES = ("sinkhorn.py", "maps.py", "successors.py")

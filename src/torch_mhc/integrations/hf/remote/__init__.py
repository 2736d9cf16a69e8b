"""The code that folders loaded by transformers alone carry beside their weights (remote code).

Two kinds of folder: a converted transformers model's portable checkpoint
(torch_mhc.hf.save_pretrained: configuration_torch_mhc.py, modeling_torch_mhc.py,
checkpoint_torch_mhc.py, which writes such a folder for either) and an
exported reference-LM run (`mhc export-hf`: configuration_torch_mhc_lm.py,
modeling_torch_mhc_lm.py). Both also carry connections.py (the connection modules) and
verbatim copies of torch_mhc/functional/{sinkhorn,maps,successors}.py (the maths), so that
transformers loads them with trust_remote_code=True where torch-mhc is not installed. The
files import only torch, transformers (and its safetensors) and each other; the package
imports the configuration modules and checkpoint_torch_mhc.py only, since the others import
the functional copies as their siblings.
"""

from pathlib import Path

__all__ = ["FUNCTIONAL_FILES", "LM_FILES", "REMOTE_DIR"]

REMOTE_DIR = Path(__file__).resolve().parent
# copied from torch_mhc/functional into every folder
FUNCTIONAL_FILES = ("sinkhorn.py", "maps.py", "successors.py")
# copied from this folder into an exported run's folder (a converted model's folder: the
# names checkpoint_torch_mhc.CODE_FILES lists)
LM_FILES = ("configuration_torch_mhc_lm.py", "modeling_torch_mhc_lm.py", "connections.py")

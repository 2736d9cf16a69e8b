"""The code a portable checkpoint carries beside its weights (transformers' remote code).

torch_mhc.hf.save_pretrained copies configuration_torch_mhc.py, modeling_torch_mhc.py and
torch_mhc/functional/{sinkhorn,maps,successors}.py into the folder, so that transformers
alone (with trust_remote_code=True) loads the converted model. The files import only torch,
transformers (and its safetensors) and each other: the library imports the configuration
module only, since modeling_torch_mhc imports the functional copies as its siblings.
"""

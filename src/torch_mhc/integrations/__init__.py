"""Integrations with other training frameworks, each behind its own extra.

    torchtitan   torch_mhc.integrations.torchtitan   (pip install -e ".[torchtitan]")

Nothing here is imported by `import torch_mhc`.
"""

"""Other implementations' parameter layouts, converted to and from this library's connections.

- `deepseek_v4`: Hugging Face transformers' `DeepseekV4HyperConnection` (fn, base, scale)
  <-> `ManifoldHyperConnection` in its DeepSeek-V4 compatibility mode.
"""

from .deepseek_v4 import from_deepseek_v4, load_deepseek_v4_state_dict, to_deepseek_v4_state_dict

__all__ = ["from_deepseek_v4", "load_deepseek_v4_state_dict", "to_deepseek_v4_state_dict"]

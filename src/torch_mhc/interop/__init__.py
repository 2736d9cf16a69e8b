"""Other implementations' parameter layouts, converted to and from this library's modules.

- `deepseek_v4`: Hugging Face transformers' `DeepseekV4HyperConnection` (fn, base, scale)
  <-> `ManifoldHyperConnection` in its DeepSeek-V4 compatibility mode, and its
  `DeepseekV4HyperHead` (hc_fn, hc_base, hc_scale) <-> `StreamHead`.
"""

from .deepseek_v4 import (
    from_deepseek_v4,
    from_deepseek_v4_head,
    load_deepseek_v4_head_state_dict,
    load_deepseek_v4_state_dict,
    to_deepseek_v4_head_state_dict,
    to_deepseek_v4_state_dict,
)

__all__ = [
    "from_deepseek_v4",
    "from_deepseek_v4_head",
    "load_deepseek_v4_head_state_dict",
    "load_deepseek_v4_state_dict",
    "to_deepseek_v4_head_state_dict",
    "to_deepseek_v4_state_dict",
]

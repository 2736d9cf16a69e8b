"""One op interface, several implementations, chosen by device and overridable.

Every implementation provides the same functions with the same contracts as `functional.maps`
and `functional.successors` (the plain-torch oracles):

    mhc_maps(x, phi, alpha, b_pre, b_post, b_res, sinkhorn_iters=20, norm_eps=1e-6,
             sinkhorn_eps=0.0, pre_eps=0.0)    -> H_pre [..., n], H_post [..., n], H_res [..., n, n]
    hc_maps(x, w, s_alpha, s_beta, static_pre, static_post, static_res, norm_eps=1e-6)
                                              -> the same three maps, HC's definition
    mhc_maps_pre(same arguments as mhc_maps)  -> H_pre, H_post, H_res, pre_aggregate(x, H_pre)
                                              (one node: an implementation may fuse them)
    hc_maps_pre(same arguments as hc_maps)    -> the same for HC's maps
    pre_aggregate(x, h_pre)                   -> [..., C]     sum_j H_pre[j] x[j]
    post_merge(x, f, h_post, h_res)           -> [..., n, C]  H_res x + H_post^T f
    sinkhorn(logits, iters=20, *, eps=0.0)    -> [..., n, n]
    variant_maps(kind, x, phi, alpha, b_pre, b_post, b_res=None, norm_eps=1e-6)
                                              -> H_pre, H_post, H_res of mHC's successor `kind`
                                              (functional.successors.variant_maps)
    variant_maps_pre(same arguments)          -> the same plus pre_aggregate(x, H_pre)

Optionally (`cpu` and `triton`): Ops.decoder(kind, decode_args) prepares a connection's
decoding step without autograd: two native calls (ops/cpu/decode.py), or the Triton launches
planned once (ops/triton/decode.py). Ops.fused_dx:
mhc_maps_pre(..., fused_dx=True) and hc_maps_pre(..., fused_dx=True) also return x_for_merge,
and post_merge(x_for_merge, f, h_post, h_res, fused_dx=True) leaves x's gradient through the
merge to the maps node, so that a connection writes x's gradient once (x_for_merge is None
where the implementation made no single node: then the merge takes x and autograd adds the
gradients); so does variant_maps_pre(..., fused_dx=True). `cpu` fuses every kind with maps of
its own; `triton` fuses mHC's (ops/triton/ops.py (f)), not HC's or the successors'.

The successors' maps (variant_maps, variant_maps_pre) are fused on `cpu` (ops/cpu/variants.py:
mHC's native maps passes, forward and backward, with the kind's closed-form H_res in place of
Sinkhorn; decoding takes the same prepared two calls as mHC) and on `triton` (ops/triton/ops.py
(e): mHC's matmul kernels with the kind's per-token maps, then its pre_aggregate). `inductor`
has no kernel for them: its Ops compose the reference variant_maps with its own pre_aggregate
(the merge still runs on its post_merge).

Implementations:
    "reference"  plain torch, autograd through every op: the definition and the test oracle
    "cpu"        hand-written backward passes and CPU-friendly layouts (ops/cpu/ops.py)
    "triton"     Triton kernels as torch.library custom ops (ops/triton/ops.py); CUDA tensors,
                 or CPU tensors under TRITON_INTERPRET=1 (for tests)
    "inductor"   the reference ops compiled by torch.compile (ops/inductor.py), any device;
                 compiles on each op's first call (meta tensors and dispatch modes run the
                 reference functions uncompiled). Never chosen by "auto".

Choosing: `get_impl(name, device, dtype)`. A name other than "auto" is used as given.
"auto" resolves, first match wins, to: "reference" under a torch.func transform (vmap, grad,
jacrev, ...); the name set by `set_default_impl`; the environment variable TORCH_MHC_IMPL;
"triton" for CUDA tensors (fp32/fp16/bf16) when triton is importable; "cpu" for CPU tensors
and for float64 anywhere; "reference" otherwise.
Under a torch.func transform only the reference runs: the other implementations' autograd
Functions compute their own backward and read their inputs' memory, which the transforms'
wrapped tensors do not have; "cpu", "triton" or "inductor" asked for by name there is a
RuntimeError that says so.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torch_mhc.functional import maps as reference
from torch_mhc.functional import successors as reference_successors
from torch_mhc.functional.sinkhorn import func_transform_active
from torch_mhc.ops import checks
from torch_mhc.ops.checks import ImplUnavailableError, UnknownImplError

# Imported here, outside any torch.compile trace: importing `cpu` registers its custom ops
# (its native library is built or loaded by the first native op, ops/cpu/native.py).
from torch_mhc.ops.cpu import decode as cpu_decode
from torch_mhc.ops.cpu import ops as cpu
from torch_mhc.ops.cpu import variants as cpu_variants

__all__ = [
    "IMPLS",
    "ImplUnavailableError",
    "Ops",
    "UnknownImplError",
    "check_impl_name",
    "check_runs_on",
    "cpu",
    "get_impl",
    "impl_state",
    "reference",
    "resolve_impl_name",
    "set_default_impl",
]

IMPLS = ("reference", "cpu", "triton", "inductor")
ENV_VAR = "TORCH_MHC_IMPL"



def _triton_ops_module():
    # A plain import statement, not importlib: Dynamo runs it while tracing (fullgraph=True).
    from torch_mhc.ops.triton import ops as triton_ops

    return triton_ops


def _triton_decoder():
    from torch_mhc.ops.triton import decode as triton_decode

    return triton_decode.decoder


def _inductor_module():
    from torch_mhc.ops import inductor

    return inductor


# The module holding each implementation, returned by a loader called on first use: triton's
# is imported only when asked for; reference and cpu are imported above.
_MODULES = {
    "reference": lambda: reference,
    "cpu": lambda: cpu,
    "triton": _triton_ops_module,
    "inductor": _inductor_module,
}


@dataclass(frozen=True)
class Ops:
    """The ops of one implementation (see the module docstring for the contracts)."""

    name: str
    mhc_maps: Callable
    mhc_maps_pre: Callable
    hc_maps: Callable
    hc_maps_pre: Callable
    pre_aggregate: Callable
    post_merge: Callable
    sinkhorn: Callable
    variant_maps: Callable
    variant_maps_pre: Callable
    # mhc_maps_pre(..., fused_dx=True) and post_merge(..., fused_dx=True) exist
    # (ops/cpu/ops.py, ops/triton/ops.py (f): x's gradient through maps, aggregation and
    # merge built in one buffer, not added by autograd).
    fused_dx: bool = False
    # decoder(kind, decode_args) -> a prepared no-autograd path for one connection, or None
    # (ops/cpu/decode.py, ops/triton/decode.py; decode_args: the maps op's arguments, x first).
    decoder: Callable | None = None


_default: str | None = None  # set by set_default_impl
_loaded: dict[str, Ops] = {}


def check_impl_name(name: str) -> str:
    """Return name if it is "auto" or an implementation; else raise UnknownImplError (a
    ValueError)."""
    if name == "auto" or name in IMPLS:
        return name
    raise UnknownImplError(f"unknown op implementation {name!r}; expected one of "
                           f"{('auto', *IMPLS)}")


def set_default_impl(name: str | None) -> None:
    """Set what "auto" means everywhere (None or "auto" restores the device-based choice)."""
    global _default
    _default = None if name is None or check_impl_name(name) == "auto" else name


# Dynamo cannot trace importlib.util.find_spec: under torch.compile the answer is taken at
# trace time and kept as a constant (as it is anyway: the installed packages do not change).
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


# The mark torch.compiler.assume_constant_result sets, set directly: calling that function
# imports torch._dynamo (about 3 s, and triton's native library) at `import torch_mhc`.
_triton_available._dynamo_marked_constant = True


# os.environ's own mapping, read directly: os.environ.get runs four Python functions (the
# key's encoding among them), which a connection's decoding step, at every call, felt. The
# mapping is the one os.environ's setters and deleters update, so it answers the same.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV_VAR) if _ENV_DATA is not None else None


def _env_impl() -> str:
    """TORCH_MHC_IMPL as os.environ holds it, stripped ("" when unset)."""
    if _ENV_DATA is None:
        return os.environ.get(ENV_VAR, "").strip()
    value = _ENV_DATA.get(_ENV_KEY)
    return "" if value is None else os.environ.decodevalue(value).strip()


def impl_state(name: str) -> tuple:
    """What resolve_impl_name(name, device, dtype) depends on besides device and dtype:
    whatever was prepared under one state (a connection's decoders) still applies while the
    state compares equal."""
    return name, _default, _env_impl()


def resolve_impl_name(
    name: str = "auto",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    """The implementation name that `get_impl` would load (see the module docstring)."""
    check_impl_name(name)
    if func_transform_active():
        if name in ("auto", "reference"):
            return "reference"
        raise RuntimeError(
            f"torch_mhc's {name!r} ops do not run under torch.func transforms (vmap, grad, "
            "jacrev, functional_call under grad, ...): they compute their own backward from "
            "their inputs' memory; use impl=\"reference\", or \"auto\", which takes it "
            "under these transforms")
    if name != "auto":
        return name
    if _default is not None:
        return _default
    env = _env_impl()
    if env:
        try:
            if check_impl_name(env) != "auto":
                return env
        except UnknownImplError as err:
            raise UnknownImplError(f"environment variable {ENV_VAR}: {err}") from None
    if isinstance(device, torch.device):  # a connection's x.device, at every call
        device_type = device.type
    else:
        device_type = torch.device(device).type if device is not None else "cpu"
    if dtype == torch.float64 or device_type == "cpu":
        return "cpu"
    if device_type == "cuda" and _triton_available():
        return "triton"
    return "reference"


def check_runs_on(name: str, device: torch.device | str,
                  dtype: torch.dtype | None = None) -> str:
    """resolve_impl_name(name, device, dtype), checked to run there: ImplUnavailableError for
    the triton ops off the GPU (unless Triton's interpreter runs them, TRITON_INTERPRET=1), as
    a command checks its input before it starts rather than at the first op."""
    resolved = resolve_impl_name(name, device, dtype)
    device = torch.device(device)
    if (resolved == "triton" and device.type != "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"):
        chosen = f"impl={name!r}" if name != "auto" else f"{ENV_VAR}=triton"
        raise ImplUnavailableError(f"{chosen}: the triton ops run on a GPU, got device "
                                   f"{device}; on the CPU use cpu, reference or inductor")
    return resolved


def _composed_maps_pre(module, maps: Callable) -> Callable:
    """maps (mhc_maps or hc_maps) then pre_aggregate, for implementations without a fused
    mhc_maps_pre or hc_maps_pre."""

    def maps_pre(x, *args, **kwargs):
        h_pre, h_post, h_res = maps(x, *args, **kwargs)
        return h_pre, h_post, h_res, module.pre_aggregate(x, h_pre)

    return maps_pre


def _variant_ops(resolved: str, module) -> dict:
    """variant_maps and variant_maps_pre of implementation `resolved`: cpu's fused ones,
    triton's kernels, or the reference maps with the implementation's own pre_aggregate."""
    if resolved == "cpu":
        return dict(variant_maps=cpu_variants.variant_maps,
                    variant_maps_pre=cpu_variants.variant_maps_pre)
    if resolved == "triton":
        return dict(variant_maps=module.variant_maps, variant_maps_pre=module.variant_maps_pre)

    def variant_maps_pre(kind, x, *args, **kwargs):
        maps = reference_successors.variant_maps(kind, x, *args, **kwargs)
        return (*maps, module.pre_aggregate(x, maps[0]))

    return dict(variant_maps=reference_successors.variant_maps,
                variant_maps_pre=variant_maps_pre)


def get_impl(
    name: str = "auto",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Ops:
    """The ops of implementation `name`, or of the one "auto" picks for device and dtype."""
    resolved = resolve_impl_name(name, device, dtype)
    ops = _loaded.get(resolved)
    return ops if ops is not None else _load(resolved)


def _checked_reference() -> dict:
    """The reference's map ops behind the scalar checks of the other implementations
    (ops/checks.py; functional.maps, the definition, stays as written)."""

    def mhc_maps(x, phi, alpha, b_pre, b_post, b_res, sinkhorn_iters=20, norm_eps=1e-6,
                 sinkhorn_eps=0.0, pre_eps=0.0):
        checks.check_maps_scalars("mhc_maps", sinkhorn_iters, norm_eps, sinkhorn_eps, pre_eps)
        return reference.mhc_maps(x, phi, alpha, b_pre, b_post, b_res, sinkhorn_iters,
                                  norm_eps, sinkhorn_eps, pre_eps)

    def hc_maps(x, w, s_alpha, s_beta, static_pre, static_post, static_res, norm_eps=1e-6):
        checks.check_hc_scalars("hc_maps", norm_eps)
        return reference.hc_maps(x, w, s_alpha, s_beta, static_pre, static_post, static_res,
                                 norm_eps)

    def sinkhorn(logits, iters=20, *, eps=0.0):
        checks.check_sinkhorn_scalars("sinkhorn", iters, eps)
        return reference.sinkhorn(logits, iters, eps=eps)

    return dict(mhc_maps=mhc_maps, hc_maps=hc_maps, sinkhorn=sinkhorn)


def _load(resolved: str) -> Ops:
    """Import implementation `resolved` and keep its Ops (traceable by Dynamo: no importlib)."""
    if resolved == "triton" and not _triton_available():
        raise ImportError(
            "the 'triton' op implementation needs the triton package "
            "(pip install -e '.[triton]' in the torch-mhc checkout); use impl='cpu' or "
            "'reference' without it"
        )
    module = _MODULES[resolved]()
    fns = {name: getattr(module, name) for name in ("mhc_maps", "hc_maps", "sinkhorn")}
    if resolved == "reference":
        fns = _checked_reference()
    ops = Ops(
        name=resolved,
        mhc_maps=fns["mhc_maps"],
        mhc_maps_pre=getattr(module, "mhc_maps_pre", None)
        or _composed_maps_pre(module, fns["mhc_maps"]),
        hc_maps=fns["hc_maps"],
        hc_maps_pre=getattr(module, "hc_maps_pre", None)
        or _composed_maps_pre(module, fns["hc_maps"]),
        pre_aggregate=module.pre_aggregate,
        post_merge=module.post_merge,
        sinkhorn=fns["sinkhorn"],
        **_variant_ops(resolved, module),
        fused_dx=getattr(module, "FUSED_DX", False),
        decoder=(cpu_decode.decoder if resolved == "cpu"
                 else _triton_decoder() if resolved == "triton" else None),
    )
    _loaded[resolved] = ops
    return ops

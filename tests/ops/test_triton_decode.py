"""The `triton` decoding path (ops/triton/decode.py): a connection called without autograd on
few tokens runs its kernels from launches planned once. Checked against the ops' path of
the same connection (the same kernels and arguments: equal bit for bit) and the reference
connection, and that the prepared launches follow parameter changes and step aside where
they do not apply.

The kernels run as in tests/ops/test_triton.py (its docstring says why): on a GPU in this
process; without one in a fresh process with TRITON_INTERPRET=1 from the start, started by
`test_kernels_in_a_fresh_interpreter_process`; run directly that way, in-process:

    TRITON_INTERPRET=1 pytest tests/ops/test_triton_decode.py
"""

import copy
import gc
import weakref

import pytest
import torch

pytest.importorskip("triton")

from tests.helpers.op_cases import Branch, assert_close, perturbed  # noqa: E402
from tests.helpers.triton_env import (  # noqa: E402
    DEVICE,
    DTYPES,
    RUN_HERE,
    TOL,
    kernel_test,
    run_in_fresh_interpreter,
    tri,
)
from torch_mhc import HyperConnection, ManifoldHyperConnection  # noqa: E402
from torch_mhc.connections import base  # noqa: E402
from torch_mhc.connections.base import prepared_decoder  # noqa: E402
from torch_mhc.connections.successors import make_variant  # noqa: E402
from torch_mhc.functional.successors import VARIANT_KINDS  # noqa: E402
from torch_mhc.tools.bench.decode_call import ops_path_call  # noqa: E402

C = 24


def _connection(kind: str, n: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    if kind in VARIANT_KINDS:
        conn = make_variant(kind, C, n, 1, Branch(C), impl="triton")
    else:
        cls = ManifoldHyperConnection if kind == "mhc" else HyperConnection
        conn = cls(C, n, 1, Branch(C), impl="triton")
    return perturbed(conn, seed=seed).to(DEVICE)


def _prepared(conn) -> list:
    from torch_mhc.ops.triton import decode

    return [d for d in base._DECODERS.get(id(conn), {}).values()
            if isinstance(d, decode.Decoder)]


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(1, 1), (3, 1), (2,)])
@pytest.mark.parametrize("kind, n", [("mhc", 4), ("mhc", 3), ("mhc-lite", 3), ("kromhc", 4),
                                     ("mhc-static-res", 4)])
def test_decoding_equals_the_ops_path_bit_for_bit(kind, n, lead, dtype):
    conn = _connection(kind, n, seed=n).to(dtype)
    x = torch.randn(*lead, n, C).to(DEVICE, dtype)
    with torch.no_grad():
        out = conn(x)
        again = conn(x)  # the second call runs the prepared launches again
        through_ops = ops_path_call(conn, x)
        ref = copy.deepcopy(conn).to("cpu", torch.float32)
        ref.impl = "reference"
        expected = ref(x.cpu().float())
    assert len(_prepared(conn)) == 1
    assert out.dtype == dtype and out.device == x.device
    assert torch.equal(out, through_ops)
    assert torch.equal(again, out)
    assert_close(out.cpu().float(), expected, TOL[dtype])


@kernel_test
def test_the_launches_are_planned_once_per_shape(monkeypatch):
    conn = _connection("mhc")
    planned = []
    for name in ("plan_maps_fwd", "plan_pre_fwd", "plan_merge_fwd"):
        plan = getattr(tri, name)
        monkeypatch.setattr(tri, name, lambda *a, _plan=plan, _name=name, **k: (
            planned.append(_name), _plan(*a, **k))[1])
    x1, x8 = torch.randn(1, 1, 4, C, device=DEVICE), torch.randn(8, 1, 4, C, device=DEVICE)
    with torch.no_grad():
        for _ in range(3):
            conn(x1)
        assert planned == ["plan_maps_fwd", "plan_pre_fwd", "plan_merge_fwd"]
        for _ in range(3):
            conn(x8)
    assert len(planned) == 6 and len(_prepared(conn)) == 2


@kernel_test
@pytest.mark.parametrize("kind", ["mhc", "kromhc"])
def test_decoding_follows_changes_of_the_parameters_and_options(kind):
    conn = _connection(kind, seed=1)
    x = torch.randn(2, 1, 4, C, device=DEVICE)
    opt = torch.optim.SGD(conn.parameters(), lr=1e-2)
    with torch.no_grad():
        before = conn(x)
    conn(x.clone().requires_grad_()).square().sum().backward()
    opt.step()
    with torch.no_grad():
        after_step = conn(x)
        assert (after_step - before).abs().max() > 1e-5
        assert torch.equal(after_step, ops_path_call(conn, x))
        conn.norm_eps = 10.0
        after_option = conn(x)
        assert (after_option - after_step).abs().max() > 1e-5
        assert torch.equal(after_option, ops_path_call(conn, x))


@kernel_test
def test_the_prepared_launches_step_aside_where_they_do_not_apply():
    from torch_mhc.ops.triton import decode

    conn = _connection("mhc")
    args = conn.decode_args(torch.randn(1, 1, 4, C, device=DEVICE))
    assert isinstance(decode.decoder("mhc", args), decode.Decoder)
    many = torch.randn(decode.MAX_TOKENS + 1, 4, C, device=DEVICE)
    assert decode.decoder("mhc", conn.decode_args(many)) is None  # a prompt: the ops' path
    assert decode.decoder("hc", args) is None  # HC's maps are torch ops on triton
    double = torch.randn(1, 4, C, device=DEVICE, dtype=torch.float64)
    assert decode.decoder("mhc", conn.decode_args(double)) is None  # the ops refuse it
    bad = (args[0], args[1][:-1], *args[2:])  # a misshapen phi: the ops say what is wrong
    assert decode.decoder("mhc", bad) is None
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert decode.decoder("mhc", args) is None
    hc = _connection("hc")
    with torch.no_grad():
        hc(torch.randn(1, 1, 4, C, device=DEVICE))
    assert _prepared(hc) == []


@kernel_test
def test_a_wrong_branch_output_is_refused_and_another_layout_converted():
    mode = ["plain"]

    def branch(h):
        if mode[0] == "wide":
            return torch.zeros(*h.shape[:-1], C + 1, device=h.device)
        if mode[0] == "double":
            return h.double()
        if mode[0] == "strided":
            return h.transpose(0, 1).contiguous().transpose(0, 1)
        return h

    torch.manual_seed(3)
    conn = perturbed(ManifoldHyperConnection(C, 4, 1, branch, impl="triton"), seed=3)
    conn.to(DEVICE)
    x = torch.randn(2, 3, 4, C, device=DEVICE)
    with torch.no_grad():
        want = conn(x)
        assert len(_prepared(conn)) == 1
        mode[0] = "wide"
        with pytest.raises(ValueError, match="post_merge expects f of shape"):
            conn(x)
        mode[0] = "double"  # refused as the ops' post_merge refuses it
        with pytest.raises(TypeError, match="post_merge supports float32, float16 and "
                                            "bfloat16 tensors, got torch.float64"):
            conn(x)
        mode[0] = "strided"
        assert torch.equal(conn(x), want)


@kernel_test
def test_a_decoder_keeps_no_call_s_tensors_and_outlives_a_call_it_refuses():
    """The tensors a decoder was planned with (the first call's x, its branch input and
    output) are not kept; a call it does not take (autocast) leaves it for the next."""
    conn = _connection("mhc")
    x = torch.randn(2, 1, 4, C, device=DEVICE)
    first = torch.randn(2, 1, 4, C, device=DEVICE)
    gone = weakref.ref(first)
    with torch.no_grad():
        out = conn(first)
        del first, out
        gc.collect()
        assert gone() is None
        (dec,) = _prepared(conn)
        want = conn(x)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):  # the ops' path, as without one
            assert torch.equal(conn(x), ops_path_call(conn, x))
        assert _prepared(conn) == [dec] and prepared_decoder(conn, x) is dec
        assert torch.equal(conn(x), want)


@kernel_test
def test_a_failing_launch_names_the_op_and_the_way_out(monkeypatch):
    from torch_mhc.ops.triton import decode

    conn = _connection("mhc")
    x = torch.randn(1, 1, 4, C, device=DEVICE)

    def broken(self, launch, names):
        original(self, launch, names)
        self.run = lambda *a, **k: (_ for _ in ()).throw(ValueError("no such kernel"))

    original = decode._Prepared.__init__
    monkeypatch.setattr(decode._Prepared, "__init__", broken)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"(?s)mhc_xphi_kernel.*decoding"
                                        r".*no such kernel.*impl='inductor'"):
        conn(x)


@kernel_test
@pytest.mark.skipif(DEVICE != "cpu", reason="no_launches stands in for the interpreter's kernels")
def test_no_launches_keeps_the_host_work_and_restores_the_kernels(monkeypatch):
    """benchmarks/profile_decode_call.py --no-launches: inside the block every launch of the
    prepared path and of the ops' path goes to a stand-in; after it the kernels are back."""
    from torch_mhc.ops.triton import kernels
    from torch_mhc.tools.bench import decode_call

    launched = []
    stand_in = decode_call._NoLaunch.__getitem__

    def recorded(self, grid):
        run = stand_in(self, grid)
        return lambda *args, **kwargs: (launched.append(self.__name__), run(*args, **kwargs))

    monkeypatch.setattr(decode_call._NoLaunch, "__getitem__", recorded)
    conn = _connection("mhc")
    x = torch.randn(1, 1, 4, C)
    real = kernels.merge_fwd_kernel
    with torch.no_grad():
        want = conn(x)
        with decode_call.no_launches():
            base._DECODERS.clear()
            conn(x)  # plans (the launches it prepares are the stand-ins) and launches
            conn(x)
            decode_call.ops_path_call(conn, x)
        assert kernels.merge_fwd_kernel is real
        assert torch.equal(conn(x), want)
    one_call = ["mhc_xphi_kernel", "mhc_maps_fwd_kernel", "pre_fwd_kernel", "merge_fwd_kernel"]
    assert launched == one_call * 3


@pytest.mark.skipif(RUN_HERE, reason="the kernel tests run in this process")
def test_kernels_in_a_fresh_interpreter_process():
    """Run this module's kernel tests where TRITON_INTERPRET=1 precedes any triton import."""
    run_in_fresh_interpreter(__file__)


@pytest.mark.skipif(RUN_HERE, reason="CPU tensors there run in the interpreter")
def test_cpu_tensors_get_no_prepared_launches_outside_the_interpreter():
    from torch_mhc.ops.triton import decode

    conn = ManifoldHyperConnection(C, 4, 1, Branch(C), impl="reference")
    assert decode.decoder("mhc", conn.decode_args(torch.randn(1, 4, C))) is None

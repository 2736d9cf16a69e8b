"""The `cpu` decoding path (ops/cpu/decode.py): a connection called without autograd runs
two prepared native calls. Checked against the autograd path of the same connection (the
same native loops: equal bit for bit) and against the reference connection; and that the
prepared calls follow every change of the parameters, shapes, threads and copies."""

import copy
import pickle
import threading
import warnings

import pytest
import torch

from tests.helpers.op_cases import TOL, Branch, assert_close, perturbed
from torch_mhc import HyperConnection, ManifoldHyperConnection
from torch_mhc import ops as ops_
from torch_mhc.connections import base
from torch_mhc.connections.successors import make_variant
from torch_mhc.functional.successors import VARIANT_KINDS
from torch_mhc.ops.cpu import build as native_build
from torch_mhc.ops.cpu import decode, native
from torch_mhc.runtime import diagnostics

C = 40


@pytest.fixture(autouse=True)
def _native_library():
    if native.load() is None:
        pytest.skip("native CPU library unavailable (no C compiler, or TORCH_MHC_NATIVE=0)")


SUCCESSORS = [("mhc-lite", 4), ("mhc-lite", 3), ("kromhc", 4), ("kromhc", 8),
              ("mhc-static-res", 4)]


def _connection(kind: str, n: int = 4, seed: int = 0, impl: str = "cpu", **kw):
    torch.manual_seed(seed)
    if kind in VARIANT_KINDS:
        return perturbed(make_variant(kind, C, n, 1, Branch(C), impl=impl, **kw), seed=seed)
    cls = ManifoldHyperConnection if kind == "mhc" else HyperConnection
    return perturbed(cls(C, n, 1, Branch(C), impl=impl, **kw), seed=seed)


def _reference_of(conn):
    """The same connection (parameters and options) on the reference ops."""
    ref = copy.deepcopy(conn)
    ref.impl = "reference"
    return ref


def _decoders(conn) -> list:
    return [d for d in base._DECODERS.get(id(conn), {}).values() if d is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(1, 1), (8, 1), (3,), (2, 5)])
@pytest.mark.parametrize("kind, n", [("mhc", 4), ("mhc", 3), ("mhc", 8), ("hc", 4), ("hc", 2),
                                     *SUCCESSORS])
def test_decoding_equals_the_autograd_path_bit_for_bit(kind, n, lead, dtype):
    """The prepared calls run the loops mHC's (and its successors') autograd path runs:
    equal outputs (HC's autograd path takes the reference's torch ops on fewer than
    cpu._HC_NATIVE_MIN_TOKENS tokens: equal to float32 rounding), and within the dtype's
    tolerance of the reference connection."""
    conn = _connection(kind, n, seed=n).to(dtype)
    x = torch.randn(*lead, n, C).to(dtype)
    with_grad = conn(x.clone().requires_grad_()).detach()
    with torch.no_grad():
        out = conn(x)
        again = conn(x)  # the second call reuses the prepared calls
        expected = _reference_of(conn)(x)
    assert len(_decoders(conn)) == 1
    assert out.shape == x.shape and out.dtype == dtype
    tol = TOL[dtype] if dtype != torch.float32 else 2e-6
    assert torch.equal(again, out)
    if kind != "hc":
        assert torch.equal(out, with_grad)
    else:
        assert_close(out, with_grad, tol)
    assert_close(out, expected, tol)


@pytest.mark.parametrize("kind", ["mhc", "hc", "mhc-lite", "mhc-static-res"])
def test_decoding_follows_every_change_of_the_parameters(kind):
    """In-place updates (an optimizer step), a swapped storage (`param.data = ...`, which
    keeps the version), a replaced parameter and a changed option are all seen."""
    conn = _connection(kind, seed=1)
    x = torch.randn(2, 1, 4, C)
    opt = torch.optim.SGD(conn.parameters(), lr=1e-3)

    def step_and_check(previous, change):
        change()
        with torch.no_grad():
            out = conn(x)
            expected = _reference_of(conn)(x)
        assert (out - previous).abs().max() > 1e-4, change
        assert_close(out, expected, 2e-6)
        return out

    with torch.no_grad():
        out = conn(x)

    def sgd_step():
        conn(x.clone().requires_grad_()).square().sum().backward()
        opt.step()
        opt.zero_grad()

    first = "w" if kind == "hc" else "phi"
    out = step_and_check(out, sgd_step)
    p = getattr(conn, first)
    out = step_and_check(out, lambda: setattr(p, "data", p.data * 1.3))
    replaced = {"mhc": ("b_res", (4, 4)), "hc": ("static_res", (4, 4)),
                "mhc-lite": ("b_res", (24,)), "mhc-static-res": ("b_post", (4,))}[kind]
    out = step_and_check(out, lambda: setattr(
        conn, replaced[0], torch.nn.Parameter(torch.randn(replaced[1]) * 0.5)))
    if kind == "mhc":
        step_and_check(out, lambda: setattr(conn, "sinkhorn_iters", 2))
    else:
        step_and_check(out, lambda: setattr(conn, "norm_eps", 10.0))


def test_each_streams_shape_and_thread_has_its_own_prepared_calls():
    """A prefill shape and a decode shape alternate, and two threads decode at once with the
    same connection: every output is the one computed alone."""
    conn = _connection("mhc", seed=2)
    shapes = [(2, 7, 4, C), (2, 1, 4, C), (5, 4, C)]
    inputs = [torch.randn(s) for s in shapes]
    with torch.no_grad():
        alone = [_reference_of(conn)(x) for x in inputs]
        for _ in range(2):
            for x, e in zip(inputs, alone, strict=True):
                assert_close(conn(x), e, 2e-6)
    errors = []

    def worker(k):
        g = torch.Generator().manual_seed(k)
        xs = [torch.randn(3, 1, 4, C, generator=g) for _ in range(20)]
        with torch.enable_grad():  # the autograd path: no prepared calls
            want = [conn(x).detach() for x in xs]
        with torch.no_grad():
            for _ in range(20):
                for x, w in zip(xs, want, strict=True):
                    if not torch.equal(conn(x), w):
                        errors.append(k)
                        return

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(_decoders(conn)) >= 3 + 3  # three shapes here, one more shape per thread


def test_a_decoded_module_deep_copies_and_pickles():
    """The prepared calls live outside the module: deepcopy (PEFT's modules_to_save) and
    pickling work after decoding, and the copy decodes with its own parameters."""
    conn = _connection("mhc", seed=3)
    x = torch.randn(1, 1, 4, C)
    with torch.no_grad():
        out = conn(x)
    twin = copy.deepcopy(conn)
    loaded = pickle.loads(pickle.dumps(conn))
    with torch.no_grad():
        assert torch.equal(twin(x), out) and torch.equal(loaded(x), out)
        twin.phi.mul_(2.0)
        assert not torch.equal(twin(x), out)
        assert torch.equal(conn(x), out)


def test_decoding_steps_aside_where_the_prepared_path_does_not_apply():
    """Diagnostics record the maps and check_finite checks them: the ops path runs. So it
    does on the reference implementation, for float64 and for n > 8."""
    conn = _connection("mhc", seed=4)
    x = torch.randn(1, 1, 4, C)
    with torch.no_grad(), diagnostics.collect_gains() as gains:
        conn(x)
    assert len(gains.maps) == 1
    with torch.no_grad():
        conn(x)  # prepared now: the next call finds its decoder first, and still steps aside
    assert len(_decoders(conn)) == 1
    with torch.no_grad(), diagnostics.collect_gains() as gains:
        conn(x)
    assert len(gains.maps) == 1
    checked = _connection("mhc", seed=4, check_finite=True)
    with torch.no_grad(), pytest.raises(FloatingPointError, match="input streams"):
        checked(torch.full((1, 1, 4, C), float("nan")))
    assert ops_.get_impl("reference").decoder is None
    for conn, x in [(_connection("mhc", seed=5).double(), torch.randn(1, 1, 4, C).double()),
                    (_connection("mhc", n=9, seed=5), torch.randn(1, 1, 9, C))]:
        with torch.no_grad():
            out = conn(x)
            assert_close(out, _reference_of(conn)(x), 2e-6)
        assert _decoders(conn) == []


def test_parameters_made_in_inference_mode_and_misshapen_parameters():
    """Inference tensors have no version to check: no prepared calls, the same values. A
    parameter of the wrong shape never reaches the native loops (which index without
    bounds): the ops path reports it."""
    with torch.inference_mode():
        conn = _connection("mhc", seed=6)
        x = torch.randn(1, 1, 4, C)
        out = conn(x)
        assert_close(out, _reference_of(conn)(x), 2e-6)
    assert _decoders(conn) == []
    assert decode.decoder("mhc", conn.map_args(x)) is None
    bad = _connection("mhc", seed=6)
    bad.phi = torch.nn.Parameter(torch.zeros(4 * C - 1, 24))
    with torch.no_grad(), pytest.raises(ValueError, match=r"phi of shape \(160, 24\)"):
        bad(x)
    assert _decoders(bad) == []


def test_the_branch_output_is_checked_and_converted():
    """A branch output of the wrong shape is one clear error; another dtype or a
    non-contiguous layout is converted, as post_merge does."""
    torch.manual_seed(7)
    inner, mode = Branch(C), ["plain"]

    def branch(h):
        f = inner(h)
        if mode[0] == "wide":
            return torch.zeros(*h.shape[:-1], C + 1)
        if mode[0] == "double":
            return f.double()
        if mode[0] == "strided":
            return f.transpose(0, 1).contiguous().transpose(0, 1)
        return f

    conn = perturbed(ManifoldHyperConnection(C, 4, 1, branch, impl="cpu"), seed=7)
    x = torch.randn(2, 3, 4, C)
    with torch.no_grad():
        want = conn(x)
        mode[0] = "wide"
        with pytest.raises(ValueError, match="post_merge expects f of shape"):
            conn(x)
        mode[0] = "double"
        assert_close(conn(x), want, 2e-6)
        mode[0] = "strided"
        assert torch.equal(conn(x), want)
        tupled = perturbed(ManifoldHyperConnection(C, 4, 1, lambda h: (inner(h),), impl="cpu"),
                           seed=7)
        with pytest.raises(TypeError, match="the branch must return a tensor"):
            tupled(x)
        assert len(_decoders(tupled)) == 1  # the prepared path made the check


@pytest.mark.parametrize("kind", ["mhc", "hc", "kromhc"])
def test_an_empty_batch_decodes(kind):
    conn = _connection(kind, seed=8)
    with torch.no_grad():
        out = conn(torch.randn(0, 1, 4, C))
    assert out.shape == (0, 1, 4, C)
    assert len(_decoders(conn)) == 1  # through the native calls (its tensors' address is 0)


def test_a_connection_takes_its_prepared_calls_with_it():
    """The prepared calls are kept outside the module and leave when it goes."""
    import gc

    conn = _connection("mhc", seed=9)
    with torch.no_grad():
        conn(torch.randn(1, 1, 4, C))
    ident = id(conn)
    assert ident in base._DECODERS
    del conn
    gc.collect()
    assert ident not in base._DECODERS


def test_a_prepared_decoder_steps_aside_when_its_call_would_no_longer_take_it(monkeypatch):
    """The second and later calls of a decoding loop take the decoder prepared for their
    shape after a few reads (Connection._prepared_decoder). It steps aside, and the call is
    checked and computed as without it, when "auto" resolves elsewhere (the default, the
    environment, the connection's impl), when check_finite is switched on, and for input it
    was not made for."""
    conn = _connection("mhc", seed=7, impl="auto")
    ref = _reference_of(conn)
    x = torch.randn(2, 1, 4, C)
    calls = []
    mix_in = decode.Decoder.mix_in
    monkeypatch.setattr(decode.Decoder, "mix_in",
                        lambda self, x: calls.append(1) or mix_in(self, x))
    with torch.no_grad():
        expected = ref(x)
        assert_close(conn(x), expected, 2e-6)
        assert_close(conn(x), expected, 2e-6)
        assert len(calls) == 2

        def steps_aside():
            before = len(calls)
            assert_close(conn(x), expected, 2e-6)
            assert len(calls) == before
            assert_close(conn(x), expected, 2e-6)  # and is still right once prepared again

        ops_.set_default_impl("reference")
        try:
            steps_aside()
        finally:
            ops_.set_default_impl(None)
        monkeypatch.setenv("TORCH_MHC_IMPL", "reference")
        steps_aside()
        monkeypatch.delenv("TORCH_MHC_IMPL")
        conn.impl = "reference"
        steps_aside()
        conn.impl = "auto"
        conn(x)
        conn.check_finite = True
        with pytest.raises(FloatingPointError, match="input streams"):
            conn(torch.full_like(x, float("nan")))
        conn.check_finite = False
        conn(x)
        with pytest.raises(TypeError, match="expects a torch.Tensor"):
            conn(x.numpy())
        with pytest.raises(ValueError, match=r"\[\.\.\., 4, 40\]"):
            conn(x[..., :-1])
        strided = torch.randn(2, 1, C, 4).transpose(-1, -2)  # not contiguous, same shape
        assert_close(conn(strided), ref(strided), 2e-6)


def test_the_implementation_follows_the_environment(monkeypatch):
    """TORCH_MHC_IMPL set or removed between two calls is seen by the next one."""
    monkeypatch.setenv("TORCH_MHC_IMPL", "reference")
    assert ops_.resolve_impl_name("auto", torch.device("cpu"), torch.float32) == "reference"
    monkeypatch.setenv("TORCH_MHC_IMPL", " cpu ")
    assert ops_.resolve_impl_name("auto", torch.device("cpu"), torch.float32) == "cpu"
    monkeypatch.delenv("TORCH_MHC_IMPL")
    assert ops_.resolve_impl_name("auto", "cuda", torch.float32) in ("triton", "reference")
    monkeypatch.setenv("TORCH_MHC_IMPL", "nope")
    with pytest.raises(ValueError, match="environment variable TORCH_MHC_IMPL"):
        ops_.resolve_impl_name("auto", "cpu", torch.float32)


def test_a_connection_compiles_without_autograd_after_decoding_eagerly():
    """torch.compile(fullgraph=True) under no_grad traces the ops' custom ops, not the
    prepared calls the eager calls before it made."""
    conn = _connection("mhc", seed=10)
    x = torch.randn(2, 1, 4, C)
    with torch.no_grad():
        eager = conn(x)
        assert len(_decoders(conn)) == 1
        compiled = torch.compile(conn, fullgraph=True, backend="aot_eager")
        assert_close(compiled(x), eager, 1e-6)
        # and the compiled code runs again without a recompile (a guard on the trace check
        # would fail at every call outside the trace)
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(3):
                assert_close(compiled(x), eager, 1e-6)


def test_a_branch_calling_its_own_connection_gets_the_right_maps():
    """The prepared maps wait in the Decoder between its two calls: a branch that calls the
    same connection in between (same shape, same thread) takes the ops' path instead of
    overwriting them."""
    torch.manual_seed(11)
    inner, depth = Branch(C), [0]

    def branch(h):
        if depth[0] == 0:
            depth[0] += 1
            try:
                conn(other)  # the same connection, shape and thread
            finally:
                depth[0] -= 1
        return inner(h)

    conn = perturbed(ManifoldHyperConnection(C, 4, 1, branch, impl="cpu"), seed=11)
    x, other = torch.randn(2, 1, 4, C), torch.randn(2, 1, 4, C) * 3
    want = conn(x.clone().requires_grad_()).detach()
    with torch.no_grad():
        assert torch.equal(conn(x), want)
        assert torch.equal(conn(x), want)  # and the Decoder is free again afterwards
    assert not any(d.busy for d in _decoders(conn))


def test_a_subclass_that_changes_the_mixing_keeps_its_change_without_autograd():
    """A subclass overriding mix_out (or forward, mix_in, _maps_and_input) has no prepared
    path, which would skip its override; one mapping only its parameters keeps it."""

    class Clamped(ManifoldHyperConnection):
        def mix_out(self, x, f, state):
            ops, h_post, h_res, x_for_merge = state
            return super().mix_out(x, f, (ops, h_post.clamp(max=0.5), h_res, x_for_merge))

    class Remapped(ManifoldHyperConnection):
        def map_args(self, x):
            return super().map_args(x)

    assert Clamped.decode_kind is None and Remapped.decode_kind == "mhc"
    torch.manual_seed(12)
    conn = perturbed(Clamped(C, 4, 1, Branch(C), impl="cpu"), seed=12)
    x = torch.randn(2, 1, 4, C)
    with torch.no_grad():
        out = conn(x)
    assert torch.equal(out, conn(x.clone().requires_grad_()).detach())
    assert _decoders(conn) == []


@pytest.mark.parametrize("kind", ["mhc", "hc", "mhc-lite"])
def test_a_subclass_mapping_its_own_parameters_decodes_its_maps(kind):
    """A subclass whose map_args maps another parameter layout (here: phi or W doubled)
    decodes with its maps, on the first call and on the prepared calls after it."""
    conn = _connection(kind, seed=13)
    base_cls = type(conn)

    class Doubled(base_cls):
        def map_args(self, x):
            args = list(super().map_args(x))
            at = 2 if kind == "mhc-lite" else 1  # the successors' kind comes first
            args[at] = 2 * args[at]
            return tuple(args)

    doubled = Doubled.__new__(Doubled)
    doubled.__dict__.update(copy.deepcopy(conn).__dict__)
    x = torch.randn(2, 1, 4, C)
    expected = doubled(x.clone().requires_grad_()).detach()
    assert (expected - conn(x.clone().requires_grad_()).detach()).abs().max() > 1e-4
    with torch.no_grad():
        for _ in range(3):
            assert_close(doubled(x), expected, 2e-6)


def test_a_subclass_mapping_another_tensor_than_x_is_not_decoded():
    """The prepared calls run on the connection's x: a map_args handing the maps another
    tensor (here 2 x) gets the ops' path, and equals its autograd output."""

    class Scaled(ManifoldHyperConnection):
        def map_args(self, x):
            return (2 * x, *super().map_args(x)[1:])

    torch.manual_seed(15)
    conn = perturbed(Scaled(C, 4, 1, Branch(C), impl="cpu"), seed=15)
    x = torch.randn(2, 1, 4, C)
    expected = conn(x.clone().requires_grad_()).detach()
    with torch.no_grad():
        for _ in range(3):
            assert_close(conn(x), expected, 2e-6)
    assert not _decoders(conn)


def test_a_subclass_checking_its_input_checks_every_decoding_call():
    """A subclass with its own check_input: a prepared call does not skip it."""
    seen = []

    class Checked(ManifoldHyperConnection):
        def check_input(self, x):
            seen.append(x.shape)
            super().check_input(x)

    torch.manual_seed(14)
    conn = perturbed(Checked(C, 4, 1, Branch(C), impl="cpu"), seed=14)
    x = torch.randn(2, 1, 4, C)
    with torch.no_grad():
        for _ in range(3):
            conn(x)
    assert len(seen) == 3 and len(_decoders(conn)) == 1


def test_many_tokens_take_the_threaded_ops_path_and_few_shapes_are_kept():
    """From native.SINGLE_THREAD_TOKENS tokens on, the ops' path (split over threads) runs;
    at most base._MAX_DECODERS shapes are kept per connection, sharing one table copy."""
    conn = _connection("mhc", seed=13)
    with torch.no_grad():
        conn(torch.randn(1, native.SINGLE_THREAD_TOKENS, 4, C))
        assert _decoders(conn) == []
        conn(torch.randn(1, native.SINGLE_THREAD_TOKENS - 1, 4, C))
        assert len(_decoders(conn)) == 1
        for batch in range(1, 2 * base._MAX_DECODERS):
            conn(torch.randn(batch, 1, 4, C))
    kept = _decoders(conn)
    assert len(base._DECODERS[id(conn)]) <= base._MAX_DECODERS
    assert len({id(d.tables[0]) for d in kept}) == 1


@pytest.mark.parametrize("setup", ["meta", "fake"])
def test_meta_and_fake_parameters_never_reach_the_native_loops(setup):
    """(In a child process: reading a meta tensor's memory would end it.) Meta parameters
    are a clean torch error; under FakeTensorMode (any dispatch mode) the custom ops run,
    also where prepared calls were made for the shape before."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import torch
        from torch_mhc import ManifoldHyperConnection
        x = torch.randn(1, 1, 4, 16)
        if "{setup}" == "meta":
            with torch.device("meta"):
                conn = ManifoldHyperConnection(16, 4, 0, torch.nn.Linear(16, 16))
            try:
                with torch.no_grad():
                    conn(x)
            except RuntimeError as err:
                print("refused:", err)
        else:
            from torch._subclasses.fake_tensor import FakeTensorMode
            conn = ManifoldHyperConnection(16, 4, 0, torch.nn.Linear(16, 16))
            with torch.no_grad():
                conn(x)  # prepared calls for this shape, made outside the mode
            with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
                print("ran:", type(conn(x)).__name__)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert ("refused: Tensor on device meta" if setup == "meta" else "ran: FakeTensor") \
        in run.stdout


def _count_checks(monkeypatch) -> list:
    """A list that grows by one at every check of a prepared call's parameters."""
    checks = []
    params_current = decode.Decoder.params_current
    monkeypatch.setattr(decode.Decoder, "params_current",
                        lambda self, args: checks.append(1) or params_current(self, args))
    return checks


def test_frozen_connections_check_each_prepared_call_once(monkeypatch):
    """Inside frozen_connections a prepared call is checked at its first use in the block
    only: a parameter changed inside goes unseen (the caller's promise, broken here on
    purpose) until the block ends. Blocks nest; other threads check as usual."""
    conn = _connection("mhc", seed=16)
    x = torch.randn(2, 1, 4, C)
    checks = _count_checks(monkeypatch)
    with torch.no_grad():
        before = conn(x)  # builds the prepared calls (checked by Decoder.current)
        conn(x)
        assert len(checks) == 1  # outside a block: every later call
        with base.frozen_connections():
            for _ in range(4):
                assert torch.equal(conn(x), before)
            assert len(checks) == 2  # the first call in the block
            with base.frozen_connections():
                conn(x)
                conn(x)
            assert len(checks) == 3  # once in the inner block
            conn(x)
            assert len(checks) == 4  # and once more back in the outer one

            seen = []  # another thread's calls: checked at every call after its first

            def other_thread():
                with torch.no_grad():  # (grad mode is per thread too)
                    seen.extend(conn(x) for _ in range(3))

            worker = threading.Thread(target=other_thread)
            worker.start()
            worker.join()
            assert len(seen) == 3 and len(checks) == 6

            conn.phi.mul_(1.5)  # broken promise: unseen inside the block
            assert torch.equal(conn(x), before)
        after = conn(x)  # seen once the block ends
    expected = _reference_of(conn)(x.clone().requires_grad_()).detach()
    assert_close(after, expected, 2e-6)
    assert (after - before).abs().max() > 1e-4


def test_frozen_blocks_closed_out_of_order_or_on_another_thread_close(monkeypatch):
    """Blocks held by generators close in any order, and a generator may close its block on
    another thread: once every block has closed, every call is checked again."""
    conn = _connection("mhc", seed=17)
    x = torch.randn(2, 1, 4, C)
    checks = _count_checks(monkeypatch)

    def stream(n):
        with base.frozen_connections():
            for _ in range(n):
                with torch.no_grad():  # (not held across the yield: grad mode is per thread)
                    out = conn(x)
                yield out

    with torch.no_grad():
        conn(x)
    first, second = stream(3), stream(3)
    next(first)
    next(second)
    list(first)  # the outer block closes while the inner one is open
    list(second)
    finished = []  # a block opened here, closed on another thread
    third = stream(2)
    next(third)
    worker = threading.Thread(target=lambda: finished.extend(third))
    worker.start()
    worker.join()
    assert len(finished) == 1
    assert base._FROZEN.open == []
    count = len(checks)
    with torch.no_grad():
        for _ in range(3):
            conn(x)
    assert len(checks) == count + 3  # no block open: every call checked


def test_generate_checks_each_connection_once(monkeypatch):
    """LM.generate decodes inside frozen_connections: over 6 one-token steps each connection's
    prepared call is checked once (at its second step; its first builds it), the first
    connection's too (it gets expand_streams' broadcast view), and the tokens are those of
    the same steps taken one by one outside the block."""
    from torch_mhc.lm.model import LM, ModelConfig

    torch.manual_seed(0)
    model = LM(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=32,
                           connection="mhc", streams=4)).eval()
    prompt = torch.randint(0, 64, (1, 5))
    checks = _count_checks(monkeypatch)
    out = model.generate(prompt, 7, temperature=0.0)
    assert len(checks) == 4  # 2 blocks x 2 connections
    with torch.no_grad():  # the same greedy steps, each checked
        idx, cache = prompt, model.new_kv_cache(1, 11)
        logits, _ = model(idx, kv_cache=cache)
        for step in range(7):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat((idx, nxt), 1)
            if step < 6:
                logits, _ = model(nxt, kv_cache=cache, start_pos=cache.pos)
    assert torch.equal(out, idx)
    assert len(checks) == 4 + 4 * 7  # outside the block: every call (the prefill and 6 steps)


# ---------------------------------------------------------------------------------------------
# The decoding calls: decode_calls.c's built-ins, or ctypes where they do not build
# ---------------------------------------------------------------------------------------------


def _decode_with(calls, kind: str, x: torch.Tensor):
    """A fresh connection's decoding output for x with the library's decoding calls set to
    calls (restored after)."""
    lib = native.load()
    saved = lib.decoding_calls()
    lib._decoding = calls
    try:
        conn = _connection(kind, seed=21).to(x.dtype)
        with torch.no_grad():
            out = conn(x)
        assert [d._maps_call for d in _decoders(conn)] == [calls[0]]
        return out
    finally:
        lib._decoding = saved


@pytest.mark.parametrize("kind", ["mhc", "hc", "mhc-lite"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_extension_and_ctypes_decode_the_same_bits(kind, dtype):
    """Both ways into native.c's entry points pass the same block and tensors: the outputs
    are equal bit for bit, and equal the reference."""
    lib = native.load()
    module = native._decode_calls_module()
    if module is None:
        pytest.skip("the decoding extension does not build or load here")
    fresh = native.NativeOps(lib.path)
    assert [type(f).__name__ for f in fresh.decoding_calls()] == ["builtin_function_or_method"] * 2
    x = torch.randn(3, 1, 4, C).to(dtype)
    by_extension = _decode_with((module.maps, module.merge), kind, x)
    by_ctypes = _decode_with((lib._lib.decode_maps, lib._lib.decode_merge), kind, x)
    assert torch.equal(by_extension, by_ctypes)
    with torch.no_grad():
        expected = _reference_of(_connection(kind, seed=21).to(dtype))(x)
    assert_close(by_extension, expected, TOL[dtype] if dtype != torch.float32 else 2e-6)


def test_the_decoding_extension_refuses_what_is_not_an_address():
    module = native._decode_calls_module()
    if module is None:
        pytest.skip("the decoding extension does not build or load here")
    with pytest.raises(TypeError, match=r"maps expects 3 addresses, got 2 arguments"):
        module.maps(1, 2)
    with pytest.raises(TypeError, match=r"merge expects int addresses, got str for argument 3"):
        module.merge(1, 2, "f", 4)
    with pytest.raises(ValueError, match=r"maps expects the call block's address, got 0"):
        module.maps(0, 0, 0)
    with pytest.raises(OverflowError):
        module.merge(1 << 70, 0, 0, 0)


@pytest.mark.parametrize("how", ["no compiler", "failing compiler", "no Python.h",
                                 "not an extension"])
def test_decoding_calls_go_through_ctypes_where_the_extension_does_not_build(
        monkeypatch, tmp_path, how):
    """No compiler, a failing build, no Python headers, or a file that is no extension
    module: no warning, the library's own functions through ctypes, the same results."""
    monkeypatch.setenv("TORCH_MHC_CACHE", str(tmp_path / "cache"))
    if how == "no compiler":
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setenv("PATH", "")
    elif how == "failing compiler":
        monkeypatch.setenv("CC", "false")
    elif how == "no Python.h":
        monkeypatch.setattr(native_build.sysconfig, "get_paths",
                            lambda: {"include": str(tmp_path)})
    else:  # a compiler whose output is the native library itself: no PyInit__decode_calls
        script = tmp_path / "cc"
        script.write_text("#!/bin/sh\nwhile [ \"$#\" -gt 1 ]; do\n"
                          f"  if [ \"$1\" = \"-o\" ]; then cp '{native.load().path}' \"$2\"; fi\n"
                          "  shift\ndone\n")
        script.chmod(0o755)
        monkeypatch.setenv("CC", str(script))
    fresh = native.NativeOps(native.load().path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calls = fresh.decoding_calls()
    assert calls == (fresh._lib.decode_maps, fresh._lib.decode_merge)
    x = torch.randn(2, 1, 4, C)
    with torch.no_grad():
        expected = _reference_of(_connection("mhc", seed=21))(x)
    assert_close(_decode_with(calls, "mhc", x), expected, 2e-6)


def test_the_call_block_has_native_c_s_layout():
    """native.py's DecodeCall is native.c's decode_call (decode_calls.c reads its first two
    fields, the entry points, which entry_points fills)."""
    import ctypes

    lib = native.load()
    size = lib._lib.decode_call_size
    size.restype = ctypes.c_int64
    assert size() == ctypes.sizeof(native.DecodeCall)
    call = native.DecodeCall()
    lib.entry_points(call)
    assert call.maps == ctypes.cast(lib._lib.decode_maps, ctypes.c_void_p).value
    assert call.merge == ctypes.cast(lib._lib.decode_merge, ctypes.c_void_p).value


def test_a_cut_short_decoding_extension_is_built_again(monkeypatch, tmp_path):
    """A cached extension whose bytes no longer hash to its sidecar is rebuilt, never loaded."""
    monkeypatch.setenv("TORCH_MHC_CACHE", str(tmp_path))
    path = native_build.build_decode_calls()
    if path is None:
        pytest.skip("the decoding extension does not build here")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    again = native_build.build_decode_calls()
    assert again == path and path.read_bytes() == data


@pytest.mark.parametrize("kind", ["mhc", "hc", *VARIANT_KINDS])
def test_a_jit_trace_records_the_connection_instead_of_native_calls(kind):
    """torch.jit.trace (and the TorchScript ONNX exporter) records torch ops: a native
    decoding call would leave the traced graph without the connection, its output then the
    traced input's whatever the new input. Under the trace the connection takes its autograd
    Functions (recorded as Python ops), also where a prepared call exists for the shape."""
    conn = _connection(kind)
    x = torch.randn(1, 3, 4, C)
    with torch.no_grad():
        conn(x)  # a prepared decoding call for this shape
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's warnings about Python values
            traced = torch.jit.trace(conn, (x,), check_trace=False)
        x2 = torch.randn(1, 3, 4, C)
        assert_close(traced(x2), conn(x2), TOL[torch.float32])
        assert not torch.allclose(conn(x2), conn(x))

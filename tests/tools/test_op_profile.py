"""`mhc bench --ops --profile`: each native pass of the cpu connection step timed alone."""

import json
import os

import pytest
import torch

from torch_mhc.ops.cpu import native
from torch_mhc.ops.cpu import ops as cpu
from torch_mhc.tools.bench import op_profile
from torch_mhc.tools.cli import main

pytestmark = pytest.mark.skipif(native.load() is None, reason="native CPU library unavailable")


def test_the_profiled_passes_are_the_connection_step():
    """The passes profiled compute what the autograd step computes around an identity branch:
    the branch input, the merge and x's one gradient."""
    torch.manual_seed(0)
    d = op_profile._inputs(24, 4, 16, torch.float32, iters=5)
    passes = op_profile._passes(native.load(), d)
    *_, a = passes["maps forward"]()
    m = 24
    phi = d["phi"].clone().requires_grad_()
    ab = d["ab"]
    alpha = torch.stack([ab[0, 0], ab[0, 4], ab[0, 8]]).clone().requires_grad_()
    x = d["x"].clone().requires_grad_()
    b_pre, b_post, b_res = ab[1, :4], ab[1, 4:8], ab[1, 8:m].reshape(4, 4)
    with torch.enable_grad():
        _, h_post, h_res, f, xm = cpu.mhc_maps_pre(x, phi, alpha, b_pre, b_post, b_res,
                                                   sinkhorn_iters=5, fused_dx=True)
        out = cpu.post_merge(xm, f, h_post, h_res, fused_dx=True)
        out.backward(d["g"])
    assert torch.equal(a, f.detach())
    assert torch.equal(passes["merge forward"](), out.detach())
    dx, _, dphi = passes["maps backward"]()
    torch.testing.assert_close(dx, x.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(dphi[:, :m], phi.grad, rtol=1e-5, atol=1e-6)


def test_each_pass_s_stream_bytes_are_the_tensors_it_reads_and_writes():
    """[T, n, C] and [T, C] tensors, counted from the native passes' own inputs and outputs."""
    lib = native.load()
    d = op_profile._inputs(24, 4, 16, torch.float32, iters=5)
    x, g = d["x"], d["g"]
    lt, r, h_pre, h_post, h_res, a = lib.maps_fwd(x, d["phip"], d["ab"], 5, 1e-6, 0.0, 0.0, True)
    merged = lib.merge_fwd(x, a, h_post, h_res)
    _, df, dh_post, _ = lib.merge_bwd(x, a, h_post, h_res, g, fused_dx=True)
    dx, *_ = lib.maps_bwd(x, d["phi"], d["ab"], lt, r, None, dh_post, None, df, g, 5, 0.0, 0.0)
    assert op_profile._stream_bytes(24, 4, 16, 4) == {
        "maps forward": x.nbytes + a.nbytes,
        "merge forward": x.nbytes + a.nbytes + merged.nbytes,
        "merge backward": g.nbytes + a.nbytes + df.nbytes,
        "maps backward": x.nbytes + g.nbytes + df.nbytes + dx.nbytes}
    assert op_profile._stream_bytes(24, 4, 16, 2)["maps backward"] == (
        x.nbytes + g.nbytes + df.nbytes + dx.nbytes) // 2


def test_profile_command_prints_json_and_a_table(capsys, tmp_path):
    argv = ["bench", "--ops", "--profile", "--tokens", "32", "--dim", "16", "--repeats", "2",
            "--threads", "1", "--clock", "process", "--json", str(tmp_path / "p.json")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    result = json.loads(text[:text.index("\n| pass")])
    assert json.loads((tmp_path / "p.json").read_text()) == result  # --json: the same JSON
    assert os.listdir(tmp_path) == ["p.json"]  # written atomically: no temporary file left
    for key in ("date", "torch", "machine", "cpu_count", "load_average_start",
                "load_average_end"):
        assert key in result["config"], key
    names = ["maps forward", "maps forward, 1 Sinkhorn iteration", "merge forward",
             "merge backward", "maps backward", "allocation of the outputs",
             "thread team entry", op_profile.STREAMING, "connection step (autograd)",
             "residual x + f step (autograd)"]
    assert list(result["median_ms"]) == names
    assert result["config"]["threads"] == 1 and result["config"]["tokens"] == 32
    for name in names:
        assert 0 < result["min_ms"][name] <= result["median_ms"][name] <= result["max_ms"][name]
        assert f"| {name} |" in text
    assert "| connection step (autograd) |" in text and "100.0%" in text
    # the streaming add's bytes over its median; each pass's GiB/s and its time over its
    # bytes at that rate, as the rows print them
    rate = result["streaming_bytes_per_s"]
    assert rate == pytest.approx(3 * 32 * 4 * 16 * 4 / (result["median_ms"][op_profile.STREAMING]
                                                          / 1e3))
    for name in ["maps forward", "merge forward", "merge backward", "maps backward",
                 op_profile.STREAMING]:
        ms, nbytes = result["median_ms"][name], result["stream_bytes"][name]
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[4]) == pytest.approx(nbytes / 2**20, abs=0.05)
        assert float(cells[5]) == pytest.approx(nbytes / 2**30 / (ms / 1e3), rel=0.01, abs=0.05)
        assert float(cells[6]) == pytest.approx(ms / (nbytes / rate * 1e3), rel=0.01, abs=0.005)
    assert result["stream_bytes"]["maps backward"] == (3 * 4 + 1) * 32 * 16 * 4


def test_profile_refuses_what_the_native_passes_do_not_run():
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        op_profile.profile(tokens=8, dim=8, dtype="float16", repeats=1)

"""torch_mhc.lm.parallel: DDP, FSDP2, pipelines (1F1B, DualPipeV), DCP checkpoints, layouts.

The `distributed` tests launch 2 CPU processes with gloo through torchrun
(`torchrun --standalone` picks a free port itself) running tests/lm/dist_worker.py, and compare
what the processes measured with a single-process reference computed here from the same
functions (same model, seed, data and optimizer). Each launch has a timeout, so a hang fails
the test instead of blocking the run. Tiny model: dim 32, 4 mHC blocks, T = 16.

Tolerances. Every comparison is fp32 against fp32 with the same maths; only the order of
floating-point additions differs (a batch split over ranks or micro-batches, then averaged
by the all-reduce or summed over micro-batches). One such reordering moves a result by about
one unit in the last place (~6e-8 relative); over 4 AdamW steps the measured loss differences
were below 1e-7 relative. rtol = 1e-5 leaves a hundredfold margin for other CPUs and BLAS
builds, while a real mistake (a rank training on half the batch, a stage missing a block, a
tied gradient not summed) moves the losses by 1e-3 or more.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import launch as launch_helpers
from tests.lm import dist_worker as W
from torch_mhc.lm.parallel import (
    CheckpointError,
    DistInfo,
    init_distributed,
    load_checkpoint,
    recompute_segments,
    save_checkpoint,
    stage_block_ranges,
    stage_to_rank,
    validate_layout,
)

WORKER = Path(__file__).with_name("dist_worker.py")
LAUNCH_TIMEOUT_S = 150  # one launch takes ~10 s on 2 busy cores; a hang fails here
RTOL = 1e-5  # see the module docstring

needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="torch.distributed with the gloo backend is not available",
)


def launch(scenario: str, outdir: Path, nproc: int = 2) -> list[dict]:
    """Run the worker scenario on nproc processes (torchrun), or in one plain process when
    nproc == 1; return what each rank saved. Fails the test on error or timeout."""
    if nproc == 1:
        cmd = [sys.executable, str(WORKER), scenario, str(outdir)]
    else:
        cmd = launch_helpers.torchrun(str(WORKER), scenario, str(outdir), nproc=nproc)
    code, out = launch_helpers.run(cmd, LAUNCH_TIMEOUT_S, f"scenario {scenario!r}")
    if code != 0:
        pytest.fail(f"scenario {scenario!r} failed (exit {code}):\n{out[-6000:]}")
    return [torch.load(outdir / f"{scenario}_rank{r}.pt") for r in range(nproc)]


# --- data parallel ---------------------------------------------------------------------------


@pytest.mark.distributed
@needs_gloo
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_data_parallel_reproduces_single_process_losses(mode, tmp_path):
    """2 ranks, each on half of every global batch [4, 16], 4 AdamW steps of an mHC LM: the
    loss trajectory of one process on the whole batches."""
    ref = W.reference_losses("mhc")
    assert ref[-1] < ref[0] - 0.5  # the trajectory moves, so a comparison means something
    outs = launch(mode, tmp_path)
    assert [o["world_size"] for o in outs] == [2, 2]
    assert outs[0]["losses"] == outs[1]["losses"]  # all-reduced: one value on every rank
    torch.testing.assert_close(
        torch.tensor(outs[0]["losses"], dtype=torch.float64),
        torch.tensor(ref, dtype=torch.float64), rtol=RTOL, atol=0.0,
    )


# --- pipeline --------------------------------------------------------------------------------


@pytest.mark.distributed
@needs_gloo
@pytest.mark.parametrize(
    "schedule, placement",
    [("1f1b", [[0], [1]]), ("dualpipev", [[0, 3], [1, 2]])],
)
def test_pipeline_reproduces_single_process_loss_and_gradients(schedule, placement, tmp_path):
    """Global batch [8, 16] in 4 micro-batches on 2 ranks (1F1B: 2 stages of 2 blocks;
    DualPipeV: 4 stages of 1 block in a V). After the first step every parameter's gradient
    equals one process's gradient accumulated over the same micro-batches; the losses of 4
    AdamW steps, a forward-only evaluation and a resume from the pipeline's checkpoint match
    too."""
    ref_losses, ref_grads, ref_eval = W.reference_pipeline("mhc")
    outs = launch(f"pp_{schedule}", tmp_path)
    assert [o["stages"] for o in outs] == placement
    assert outs[0]["stage_ranges"] == stage_block_ranges(4, len(sum(placement, [])))

    grads: dict[str, torch.Tensor] = {}
    for o in outs:
        for name, g in o["grads"].items():
            assert name not in grads, f"{name} held by two ranks"
            grads[name] = g
    assert sorted(grads) == sorted(ref_grads)  # every parameter, under the LM's names
    for name, g in grads.items():
        ref = ref_grads[name]
        # atol: a tied-embedding element where the two summed contributions cancel keeps only
        # rounding noise of the larger term (~6e-8 of the tensor's scale).
        torch.testing.assert_close(g, ref, rtol=RTOL, atol=1e-6 * ref.abs().max().item(),
                                   msg=lambda m, n=name: f"gradient of {n}: {m}")
    # The tied LM head copy receives exactly the embedding's summed gradient.
    assert torch.equal(grads["lm_head.weight"], grads["tok_emb.weight"])
    # The global gradient norm counts every parameter once (the tied matrix once), as
    # clip_grad_norm_ on the single-process model does.
    ref_norm = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g) for n, g in ref_grads.items() if n != "lm_head.weight"]))
    assert outs[0]["grad_norm"] == outs[1]["grad_norm"]
    assert outs[0]["grad_norm"] == pytest.approx(ref_norm.item(), rel=RTOL, abs=0.0)

    assert outs[0]["losses"] == outs[1]["losses"]  # broadcast from the last stage
    torch.testing.assert_close(torch.tensor(outs[0]["losses"], dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=RTOL, atol=0.0)
    assert outs[0]["eval_loss"] == outs[1]["eval_loss"]
    assert outs[0]["eval_loss"] == pytest.approx(ref_eval, rel=RTOL, abs=0.0)
    # Two steps without zeroing accumulate 2x one step (a tied gradient summed twice: 3x).
    assert max(o["accumulation_error"] for o in outs) < RTOL

    # The DCP checkpoint the stages saved after step 2 (under the LM's names) resumes in one
    # plain LM, which continues with the pipeline's losses.
    (resumed,) = launch("resume_pp", tmp_path, nproc=1)
    assert resumed["extra"] == {"step": W.SAVE_AT}
    torch.testing.assert_close(
        torch.tensor(resumed["losses"], dtype=torch.float64),
        torch.tensor(outs[0]["losses"][W.SAVE_AT:], dtype=torch.float64), rtol=RTOL, atol=0.0,
    )


# --- checkpoints -----------------------------------------------------------------------------


@pytest.mark.distributed
@needs_gloo
def test_checkpoint_saved_by_two_ranks_resumes_on_one(tmp_path):
    """FSDP2 on 2 ranks saves a DCP checkpoint after 2 of 4 steps (and keeps training); one
    process without a process group loads it into a plain LM and AdamW, whose parameters
    were first moved away, and continues with the losses of the uninterrupted run. Before
    that, a save rank 0 cannot write raises on both ranks instead of hanging rank 1."""
    (tmp_path / "not_a_dir").write_text("a file where the checkpoint's parent should be")
    (saver0, saver1) = launch("ckpt_save", tmp_path)
    assert saver0["bad_save_error"].startswith(("NotADirectoryError", "FileExistsError"))
    assert saver1["bad_save_error"].startswith("RuntimeError: checkpoint I/O failed on rank 0")
    assert saver0["losses"] == saver1["losses"]
    assert (tmp_path / "ckpt" / "meta.json").is_file()
    assert not (tmp_path / "ckpt.partial").exists() and not (tmp_path / "ckpt.old").exists()

    (resumed,) = launch("resume", tmp_path, nproc=1)
    assert resumed["world_size"] == 1
    assert resumed["extra"] == {"step": W.SAVE_AT}
    torch.testing.assert_close(
        torch.tensor(resumed["losses"], dtype=torch.float64),
        torch.tensor(saver0["losses"][W.SAVE_AT:], dtype=torch.float64), rtol=RTOL, atol=0.0,
    )


def _tiny_lm_and_opt(seed: int):
    torch.manual_seed(seed)
    model = W.make_model(W.make_config())
    if seed != W.SEED:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(seed))
    return model, W.make_optimizer(model)


def _train_one_step(model, opt):
    x, y = W.make_batch(0)
    opt.zero_grad()
    model(x, y)[1].backward()
    opt.step()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    """A save that fails while writing leaves the previous checkpoint loadable and in place;
    a save interrupted between its two renames is found under `.old`."""
    import torch.distributed.checkpoint as dcp

    model, opt = _tiny_lm_and_opt(W.SEED)
    _train_one_step(model, opt)
    path = tmp_path / "ckpt"
    rng = torch.get_rng_state()
    save_checkpoint(path, model, opt, extra={"step": 1, "rng": rng})
    good = {k: v.clone() for k, v in model.state_dict().items()}

    _train_one_step(model, opt)  # the model moves on; the next save fails half-way

    def broken_save(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(dcp, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, model, opt, extra={"step": 2})
    monkeypatch.undo()

    fresh, fresh_opt = _tiny_lm_and_opt(W.SEED + 7)
    extra = load_checkpoint(path, fresh, fresh_opt)
    assert extra.keys() == {"step", "rng"} and extra["step"] == 1
    assert torch.equal(extra["rng"], rng)  # tensors travel in extra (RNG states)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, good[k]), k
    assert len(fresh_opt.state) == len(list(fresh.parameters()))  # AdamW moments restored

    path.rename(tmp_path / "ckpt.old")  # as if a save died between its two renames
    fresh2, _ = _tiny_lm_and_opt(W.SEED + 9)
    with pytest.warns(UserWarning, match="interrupted"):
        assert load_checkpoint(path, fresh2)["step"] == 1
    assert all(torch.equal(v, good[k]) for k, v in fresh2.state_dict().items())
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "nowhere", fresh2)
    with pytest.raises(TypeError, match="weights_only"):  # refused before anything is written
        save_checkpoint(tmp_path / "other", fresh2, extra={"f": lambda: 0})
    assert not (tmp_path / "other.partial").exists()


# --- process group without torchrun ----------------------------------------------------------


def test_init_distributed_without_torchrun_is_a_single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    info = init_distributed(device="cpu")
    assert info == DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    assert not info.distributed and info.is_rank0


def test_init_distributed_rejects_a_partial_environment(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="launch with torchrun"):
        init_distributed(device="cpu")


# --- layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world_size=2, parallel="ddp", n_layers=4, batch_size=5),
         "not divisible by world_size 2"),
        (dict(world_size=2, parallel="fsdp", n_layers=4, batch_size=8, micro_batches=3),
         "per-process batch 8 / 2 = 4 is not divisible into 3"),
        (dict(world_size=2, parallel="none", n_layers=4, batch_size=8), "2 were launched"),
        (dict(world_size=2, parallel="pp", n_layers=3, batch_size=8, micro_batches=4),
         "cannot be split into 2 stages"),
        (dict(world_size=2, parallel="pp", n_layers=4, batch_size=10, micro_batches=4),
         "batch_size 10 is not divisible into 4 micro-batches"),
        (dict(world_size=2, parallel="pp", n_layers=4, batch_size=8, micro_batches=2,
              schedule="dualpipev"), "micro_batches = 2 < 4 stages"),
        (dict(world_size=4, parallel="pp", n_layers=6, batch_size=8, micro_batches=8,
              schedule="dualpipev"), "need at least 8 transformer blocks"),
        (dict(world_size=2, parallel="pp", n_layers=6, batch_size=8, micro_batches=4,
              schedule="dualpipev"), "6 blocks cannot be split into 4 stages"),
        (dict(world_size=3, parallel="pp", n_layers=12, batch_size=12, micro_batches=4,
              pipeline_stages=4), "world_size 3 does not divide pipeline_stages 4"),
        (dict(world_size=1, parallel="pp", n_layers=4, batch_size=8, micro_batches=4),
         "at least 2 processes"),
        (dict(world_size=2, parallel="tp", n_layers=4, batch_size=8), "parallel must be one of"),
        (dict(world_size=2, parallel="pp", n_layers=4, batch_size=8, schedule="gpipe"),
         "schedule must be one of"),
        (dict(world_size=0, parallel="ddp", n_layers=4, batch_size=8), "world_size must be"),
    ],
)
def test_validate_layout_rejects_impossible_layouts(kwargs, message):
    with pytest.raises(ValueError, match="impossible parallel layout|must be") as err:
        validate_layout(**kwargs)
    assert message in str(err.value)


def test_validate_layout_lists_every_problem_at_once():
    with pytest.raises(ValueError) as err:
        validate_layout(2, "pp", n_layers=3, batch_size=7, micro_batches=2, schedule="dualpipev")
    text = str(err.value)
    for fragment in ("need at least 4 transformer blocks", "batch_size 7 is not divisible",
                     "micro_batches = 2 < 4 stages"):
        assert fragment in text


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(world_size=1, parallel="none", n_layers=4, batch_size=8, micro_batches=2),
        dict(world_size=2, parallel="ddp", n_layers=4, batch_size=8, micro_batches=2),
        dict(world_size=4, parallel="fsdp", n_layers=3, batch_size=8),
        dict(world_size=2, parallel="pp", n_layers=4, batch_size=8, micro_batches=4),
        dict(world_size=2, parallel="pp", n_layers=8, batch_size=8, micro_batches=4,
             schedule="dualpipev", pipeline_stages=4),
    ],
)
def test_validate_layout_accepts_possible_layouts(kwargs):
    assert validate_layout(**kwargs) is None


def test_stage_placement_matches_torch_v_schedule():
    """Our stage -> rank map is the one ScheduleDualPipeV uses (torch's "v" style)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for world in (2, 3, 4):
        assert stage_to_rank(world, "dualpipev") == generate_stage_to_rank_mapping(
            world, 2 * world, style="v")
        assert stage_to_rank(world, "1f1b") == {s: s for s in range(world)}
    assert stage_to_rank(2, "dualpipev") == {0: 0, 1: 1, 2: 1, 3: 0}


def test_stage_block_ranges_and_recompute_segments():
    assert stage_block_ranges(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="cannot be split"):
        stage_block_ranges(6, 4)
    # Segments of L_r = 3 blocks never cross the stage boundary at block 5.
    assert recompute_segments((0, 5), 3) == [(0, 3), (3, 5)]
    assert recompute_segments((5, 10), 3) == [(5, 8), (8, 10)]
    assert recompute_segments((2, 4), 8) == [(2, 4)]
    with pytest.raises(ValueError, match="blocks_per_segment"):
        recompute_segments((0, 4), 0)

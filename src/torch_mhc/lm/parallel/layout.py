"""Parallel layouts: check one before any process does work, and place blocks on stages.

A layout is the data-parallel mode ("none", "ddp", "fsdp") or pipeline parallelism ("pp")
with a schedule, over `world_size` processes. `validate_layout` raises one ValueError naming
every impossible choice, so a bad command line fails at once, in every process, before the
model is built, instead of hanging in a collective or failing deep inside a schedule.

Pipeline stages hold whole transformer blocks, an equal number each (`stage_block_ranges`),
so selective recomputation can keep one block input every L_r blocks with its segments
aligned to the stage boundaries, as in the paper (`recompute_segments`).
"""

from __future__ import annotations

__all__ = [
    "PARALLEL_MODES",
    "SCHEDULES",
    "validate_layout",
    "stages_for",
    "stage_block_ranges",
    "stage_to_rank",
    "recompute_segments",
]

PARALLEL_MODES = ("none", "ddp", "fsdp", "pp")
SCHEDULES = ("1f1b", "dualpipev")


def _is_pos_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def stages_for(world_size: int, schedule: str) -> int:
    """Number of pipeline stages a schedule runs on world_size processes.

    1F1B: one stage per process. DualPipeV: two per process in a V (rank r holds stages r and
    2 * world_size - 1 - r), so the first and the last stage share rank 0.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return world_size if schedule == "1f1b" else 2 * world_size


def validate_layout(
    world_size: int,
    parallel: str,
    n_layers: int,
    batch_size: int,
    micro_batches: int = 1,
    schedule: str = "1f1b",
    pipeline_stages: int | None = None,
) -> None:
    """Raise a ValueError listing every reason the layout cannot run; return None if it can.

    world_size: number of processes. parallel: "none" | "ddp" | "fsdp" | "pp".
    n_layers: transformer blocks of the model. batch_size: the global batch (sequences per
    optimizer step, summed over all processes).
    micro_batches: for "pp", the micro-batches the schedule splits the global batch into; for
    "ddp" / "fsdp" / "none", gradient-accumulation steps per process.
    schedule: "1f1b" | "dualpipev" (only for "pp"). pipeline_stages: optional, for "pp" only;
    when given it must be the number the schedule runs (world_size for 1F1B, 2 * world_size
    for DualPipeV), which catches a world size that does not fit a planned stage count.
    """
    _check_arguments(world_size, parallel, n_layers, batch_size, micro_batches, schedule,
                     pipeline_stages)
    if parallel == "pp":
        problems = _pipeline_problems(world_size, n_layers, batch_size, micro_batches, schedule,
                                      pipeline_stages)
    else:
        problems = _data_parallel_problems(world_size, parallel, batch_size, micro_batches,
                                           pipeline_stages)
    if problems:
        head = (f"impossible parallel layout (parallel={parallel!r}, world_size={world_size}"
                + (f", schedule={schedule!r}" if parallel == "pp" else "") + "):")
        raise ValueError("\n  - ".join([head, *problems]))


def _check_arguments(world_size, parallel, n_layers, batch_size, micro_batches, schedule,
                     pipeline_stages) -> None:
    """Each argument on its own: the right type and range (a ValueError at the first)."""
    for name, value in (("world_size", world_size), ("n_layers", n_layers),
                        ("batch_size", batch_size), ("micro_batches", micro_batches)):
        if not _is_pos_int(value):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if pipeline_stages is not None and not _is_pos_int(pipeline_stages):
        raise ValueError(f"pipeline_stages must be an integer >= 1, got {pipeline_stages!r}")


def _data_parallel_problems(world_size, parallel, batch_size, micro_batches,
                            pipeline_stages) -> list[str]:
    """What keeps "none" / "ddp" / "fsdp" from running this layout."""
    problems: list[str] = []
    if parallel == "none":
        if world_size != 1:
            problems.append(
                f"parallel='none' runs one process, but {world_size} were launched; "
                "choose ddp, fsdp or pp"
            )
        if batch_size % micro_batches != 0:
            problems.append(
                f"batch_size {batch_size} is not divisible into {micro_batches} "
                "gradient-accumulation micro-batches"
            )
        return problems
    if pipeline_stages is not None:
        problems.append(f"pipeline_stages is for parallel='pp', not {parallel!r}")
    if batch_size % world_size != 0:
        problems.append(
            f"global batch_size {batch_size} is not divisible by world_size {world_size} "
            "(every process takes an equal share)"
        )
    elif (batch_size // world_size) % micro_batches != 0:
        problems.append(
            f"the per-process batch {batch_size} / {world_size} = {batch_size // world_size} "
            f"is not divisible into {micro_batches} gradient-accumulation micro-batches"
        )
    return problems


def _pipeline_problems(world_size, n_layers, batch_size, micro_batches, schedule,
                       pipeline_stages) -> list[str]:
    """What keeps a pipeline ("pp") from running this layout."""
    problems: list[str] = []
    n_stages = stages_for(world_size, schedule)
    if world_size < 2:
        problems.append("parallel='pp' needs at least 2 processes, got world_size 1")
    if pipeline_stages is not None and pipeline_stages != n_stages:
        if pipeline_stages % world_size != 0:
            problems.append(
                f"world_size {world_size} does not divide pipeline_stages "
                f"{pipeline_stages}: every process must hold the same number of stages"
            )
        per_rank = "1 stage" if schedule == "1f1b" else "2 stages (a V)"
        problems.append(
            f"schedule {schedule!r} runs {per_rank} per process: {n_stages} stages on "
            f"{world_size} processes, but pipeline_stages = {pipeline_stages}"
        )
    if n_stages > n_layers:
        problems.append(
            f"{n_stages} pipeline stages ({schedule} on {world_size} processes) need at "
            f"least {n_stages} transformer blocks, the model has n_layers = {n_layers}"
        )
    elif n_layers % n_stages != 0:
        problems.append(
            f"n_layers = {n_layers} blocks cannot be split into {n_stages} stages of whole, "
            f"equal block counts ({schedule} on {world_size} processes)"
        )
    if batch_size % micro_batches != 0:
        problems.append(
            f"batch_size {batch_size} is not divisible into {micro_batches} micro-batches"
        )
    if micro_batches < n_stages:
        problems.append(
            f"schedule {schedule!r} needs at least as many micro-batches as stages: "
            f"micro_batches = {micro_batches} < {n_stages} stages"
        )
    return problems


def stage_block_ranges(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Blocks [start, end) of each stage, in stage order: n_layers / n_stages whole blocks each.

    The embedding (with expand_streams) belongs to stage 0 and the head (reduce_streams, final
    norm, LM head) to the last stage, on top of their blocks.
    """
    if not (_is_pos_int(n_layers) and _is_pos_int(n_stages)):
        raise ValueError(f"need integers >= 1, got n_layers={n_layers!r}, n_stages={n_stages!r}")
    if n_layers % n_stages != 0:
        raise ValueError(
            f"n_layers = {n_layers} blocks cannot be split into {n_stages} stages of whole, "
            "equal block counts"
        )
    per = n_layers // n_stages
    return [(s * per, (s + 1) * per) for s in range(n_stages)]


def stage_to_rank(world_size: int, schedule: str) -> dict[int, int]:
    """Which process runs each stage: 1F1B stage s on rank s; DualPipeV stage s on rank s for
    s < world_size and on rank 2 * world_size - 1 - s after (the V)."""
    n_stages = stages_for(world_size, schedule)
    return {s: (s if s < world_size else n_stages - 1 - s) for s in range(n_stages)}


def recompute_segments(
    block_range: tuple[int, int], blocks_per_segment: int
) -> list[tuple[int, int]]:
    """Split a stage's blocks [start, end) into recomputation segments of at most
    blocks_per_segment (L_r) blocks, never crossing the stage boundary.

    Selective recomputation keeps only each segment's input and recomputes the rest in the
    backward pass; a segment that crossed a stage boundary would need activations that live
    on another process. The last segment of a stage is shorter when L_r does not divide it.
    """
    start, end = block_range
    if not 0 <= start < end:
        raise ValueError(
            f"block_range must be [start, end) with 0 <= start < end, got {block_range}"
        )
    if not _is_pos_int(blocks_per_segment):
        raise ValueError(
            f"blocks_per_segment must be an integer >= 1, got {blocks_per_segment!r}"
        )
    return [(s, min(s + blocks_per_segment, end)) for s in range(start, end, blocks_per_segment)]

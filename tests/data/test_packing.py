"""Packed batches (`packing: true`, packing.py): the bin packing, attention that never crosses rows, and the
promise that a packed run trains like the unpacked one (same rows, same per-step loss within 1e-5) in every
layout: one process, TP=2, PP=2 (1F1B), FSDP over 2 ranks. fp32, tiny models, dropout off, real SST-2."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from conftest import assert_trains_like, launch, recipe, tiny_overrides

from parallel_finetune.data.batch import IGNORE, BatchKind, PackedBatcher, PaddedBatcher, TokenizedSplit
from parallel_finetune.data.packing import PackedShape, first_fit_decreasing, packed_slots
from parallel_finetune.errors import UserError
from parallel_finetune.families import get_family
from parallel_finetune.families.plans import PlanFamily, mask_kind
from parallel_finetune.loop.loss import CLASS_OBJECTIVE, TOKEN_OBJECTIVE
from parallel_finetune.loop.runner import WholeModel
from parallel_finetune.parallel.pipeline import Stage, StageForward, cut_model
from parallel_finetune.resolve import load_config
from parallel_finetune.tasks.task import HeadKind

TOLERANCE = 1e-5
CPU = torch.device("cpu")


# ----------------------------------------------------------------------------------------------- bin packing
def test_first_fit_decreasing_keeps_every_row_once_within_capacity_and_is_deterministic():
    draw = random.Random(7)
    for _ in range(50):
        capacity = draw.randint(8, 64)
        lengths = [draw.randint(1, capacity) for _ in range(draw.randint(1, 40))]
        bins = first_fit_decreasing(lengths, capacity)
        assert sorted(p for group in bins for p in group) == list(range(len(lengths)))
        assert all(sum(lengths[p] for p in group) <= capacity for group in bins)
        assert first_fit_decreasing(list(lengths), capacity) == bins
    # longest first, ties in row order, each into the first bin with room
    assert first_fit_decreasing([3, 5, 2, 5, 4], 8) == [[1, 0], [3, 2], [4]]


def rows_split(ids, labels=None, head=HeadKind.CLASSIFICATION, regression=False) -> TokenizedSplit:
    """A TokenizedSplit of rows in memory (what TokenizedSplit.of reads from a cached split)."""
    lengths = [len(row) for row in ids]
    targets = [1] * len(ids) if head is HeadKind.CLASSIFICATION else [n - 1 for n in lengths]
    return TokenizedSplit(head, ids, lengths, targets, labels, regression)


def packed_rows(ids, shape, labels=None, head=HeadKind.CLASSIFICATION, regression=False):
    split = rows_split(ids, labels, head, regression)
    return PackedBatcher(split, pad_id=0, shape=shape, device=CPU).batch(list(range(len(ids))))


def test_packed_batch_positions_targets_and_slots():
    ids = [[11, 12, 13], [21, 22], [31, 32, 33, 34], [41]]
    shape = PackedShape(capacity=6, pooled="last")
    batch = packed_rows(ids, shape, labels=[0, 1, 2, 3])
    # bins: [row 2 (4 tokens), row 1 (2)], [row 0 (3), row 3 (1)] -> length 6, the second with a padding tail
    assert batch.kind is BatchKind.PACKED and batch.packed
    assert batch.input_ids.tolist() == [[31, 32, 33, 34, 21, 22], [11, 12, 13, 41, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]
    assert batch.positions.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 1]]
    assert batch.labels.tolist() == [[IGNORE, IGNORE, IGNORE, 2, IGNORE, 1], [IGNORE, IGNORE, 0, 3, IGNORE, IGNORE]]
    assert batch.scored() == 4
    lm = packed_rows(ids, shape, head=HeadKind.CAUSAL_LM).labels  # shifted: never across a row, never padding
    assert lm.tolist() == [[32, 33, 34, IGNORE, 22, IGNORE], [12, 13, IGNORE, IGNORE, IGNORE, IGNORE]]
    assert packed_slots([3, 2, 4, 1], shape) == 12
    # a pipeline's static shapes: every sequence max_length long (rounded), sequences to a multiple of micro-batches
    fixed = PackedShape(capacity=6, pad_multiple=8, fixed_length=True, rows_multiple=4, pooled="first")
    batch = packed_rows(ids, fixed, labels=[0.5, 1.5, 2.5, 3.5], regression=True)
    assert batch.input_ids.shape == (4, 8) and packed_slots([3, 2, 4, 1], fixed) == 32
    assert batch.attention_mask[2:].sum() == 0 and batch.positions[3].tolist() == list(range(8))
    scored = ~batch.labels.isnan()
    assert batch.labels[scored].tolist() == [2.5, 1.5, 0.5, 3.5] and scored.sum() == 4 == batch.scored()


# ----------------------------------------------------------------------------------------------- in one process
ROWS = [
    [int(t) for t in torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(n))] for n in (5, 9, 3, 7, 2)
]
LABELS = [0, 1, 1, 0, 1]


def tiny_model(family_name: str, task: str, attention: str):
    family = get_family(family_name)
    config = family.sized_config(200, 128, 32, 2, 2)
    for key in family.dropout_keys:
        setattr(config, key, 0.0)
    family.set_task(config, task, 0)
    config._attn_implementation = attention
    torch.manual_seed(0)
    model = family.hf_model(task, config)
    family.surgery(model)  # BERT's first-token last layer: packing must make it compute every position
    if isinstance(family, PlanFamily):  # what its build marks: the mask each block takes
        for number, block in enumerate(family.blocks(model)):
            block.attention_kind = mask_kind(config, number)
    return family, model.eval()


def head_of_test(task: str) -> HeadKind:
    return HeadKind.CLASSIFICATION if task == "classification" else HeadKind.CAUSAL_LM


def packed(rows, family, labels, task="classification", capacity=12):
    shape = PackedShape(capacity=capacity, pooled=family.pooled_token)
    return packed_rows(rows, shape, labels, head_of_test(task))


MODELS = [
    pytest.param(family, task, attention, id=f"{family}-{task}-{attention}")
    for family, task in (
        ("gpt2", "classification"),
        ("gpt2", "causal_lm"),
        ("bert", "classification"),
        ("llama", "classification"),
        ("llama", "causal_lm"),
    )
    for attention in ("sdpa", "eager")
]


@pytest.mark.parametrize("family_name,task,attention", MODELS)
def test_packed_forward_equals_unpacked_and_rows_stay_apart(family_name, task, attention):
    family, model = tiny_model(family_name, task, attention)
    head = head_of_test(task)
    loss = CLASS_OBJECTIVE if head is HeadKind.CLASSIFICATION else TOKEN_OBJECTIVE
    runner = WholeModel(model, head, loss, contextlib.nullcontext, None, False, CPU, packing=family)
    labels = LABELS if task == "classification" else None
    split = rows_split(ROWS, labels, head)
    unpacked = PaddedBatcher(split, pad_id=0, padding_side="right", pad_multiple=1, device=CPU).batch(range(len(ROWS)))
    batch = packed(ROWS, family, labels, task)
    assert batch.rows < len(ROWS)  # rows did share sequences
    with torch.no_grad():
        expected, _ = loss(runner.forward(unpacked), unpacked.labels)
        logits = runner.forward(batch)
        got, _ = loss(logits, batch.labels)
        assert got.item() == pytest.approx(expected.item(), abs=TOLERANCE)
        # another row 4 (2 tokens, packed beside others): every other row's logits stay as they were
        changed = [list(row) for row in ROWS]
        changed[4] = [7, 8]
        again = runner.forward(packed(changed, family, labels, task))
    other = packed(changed, family, labels, task).positions
    row_of = _row_numbers(batch.positions)
    assert torch.equal(other, batch.positions)
    moved = (again - logits).abs().amax(-1)
    row_four = row_of == _row_number_of(batch, ROWS, 4)
    assert moved[~row_four].max() == 0 and moved[row_four].max() > 0


def _row_numbers(position_ids: torch.Tensor) -> torch.Tensor:
    """Each position's segment number within its packed sequence (a row, or the padding tail)."""
    return (position_ids == 0).cumsum(-1) + 1000 * torch.arange(position_ids.shape[0])[:, None]


def _row_number_of(batch, rows, index) -> int:
    """The segment number `_row_numbers` gives row `index` of `rows` (found by its tokens)."""
    segments = _row_numbers(batch.positions)
    for number in segments.unique():
        where = segments == number
        if batch.input_ids[where].tolist() == rows[index]:
            return int(number)
    raise AssertionError(f"row {index} is not in the packed batch")


@pytest.mark.parametrize("family_name", ["gpt2", "bert", "llama"])
def test_pipeline_stage_packed_equals_the_whole_model(family_name):
    """One stage holding every block: its packed masks and per-position head give the whole model's logits."""
    family, model = tiny_model(family_name, "classification", "sdpa")
    batch = packed(ROWS, family, LABELS)
    runner = WholeModel(
        model, HeadKind.CLASSIFICATION, CLASS_OBJECTIVE, contextlib.nullcontext, None, False, CPU, packing=family
    )
    whole = Stage(0, (0, 1), True, True)
    with torch.no_grad():
        expected = runner.forward(batch)
        cut_model(model, family, [whole])  # the blocks by their numbers, as a stage holds them
        stage = StageForward(model, family, whole, classifier=True)
        stage.packed = True
        got = stage(batch.input_ids, batch.attention_mask, batch.positions)
    scored = batch.labels != IGNORE
    assert (got[scored] - expected[scored]).abs().max() < TOLERANCE


def test_packing_refusals(tmp_path):
    gpt2 = get_family("gpt2")
    config = gpt2.sized_config(200, 128, 32, 2, 2)
    config._attn_implementation = "paged_attention"
    with pytest.raises(UserError, match="packing=true with attn_implementation=paged_attention"):
        gpt2.check_packing(config, 64)
    bert = get_family("bert").sized_config(200, 128, 32, 2, 2)
    bert._attn_implementation = "flash_attention_2"
    with pytest.raises(UserError, match="family=bert and attn_implementation=flash_attention_2"):
        get_family("bert").check_packing(bert, 64)
    mistral = get_family("mistral")
    windowed = mistral.sized_config(200, 128, 32, 2, 2)
    windowed.sliding_window = 16
    with pytest.raises(UserError, match="sliding attention window of 16 tokens, shorter than max_length=64"):
        mistral.check_packing(windowed, 64)
    mistral.check_packing(windowed, 16)  # a window no packed sequence exceeds bites nowhere
    with pytest.raises(UserError, match="packing=True is engine=torch's"):
        load_config(recipe("gptj"), ["packing=true", "engine=deepspeed"])


# ----------------------------------------------------------------------------------------------- runs
# Each row: a packed run against the unpacked one-process run of the same (family, task) (test_parity's reference
# runs: shared in a session). Causal-LM blocks fill max_length, so each packed sequence holds one: the row checks
# the packed masks, positions and targets; classification rows share sequences.
LAYOUTS = {
    "one_process": (1, []),
    "tp2": (2, ["tensor_parallel_degree=2"]),
    "pp2_1f1b": (2, ["tensor_parallel_degree=1", "pipeline_parallel_degree=2", "pipeline_schedule=1f1b"]),
    "fsdp_dp2": (2, ["tensor_parallel_degree=1", "sharding=full"]),
}
PACKED_CASES = [
    pytest.param(family, task, layout, id=f"{family}-{layout}-{task}")
    for family, task, layouts in (
        ("gpt2", "classification", ("one_process", "tp2", "pp2_1f1b", "fsdp_dp2")),
        ("gpt2", "causal_lm", ("one_process",)),
        ("bert", "classification", ("one_process", "tp2", "pp2_1f1b")),
        ("llama", "classification", ("one_process",)),
        ("llama", "causal_lm", ("one_process", "tp2", "pp2_1f1b")),
        ("llama", "sft", ("one_process", "tp2", "pp2_1f1b")),  # chat rows: shorter than max_length, they share
    )
    for layout in layouts
]


@pytest.mark.parametrize("family,task,layout", PACKED_CASES)
def test_packed_run_trains_like_unpacked(
    family, task, layout, single_process, single_process_run, sst2, cache_dir, tmp_path
):
    if task == "sft":  # the shipped chat sample, the loss on the answers only (test_chat's runs)
        from test_chat import sft_reference, sft_run_overrides

        reference = sft_reference(single_process_run, sst2, cache_dir, family)
        run_overrides = sft_run_overrides(sst2, cache_dir, family, export="true")
    else:
        reference = single_process(family, task, ())
        run_overrides = tiny_overrides(sst2, cache_dir, task, family, export="true")
    nproc, overrides = LAYOUTS[layout]
    run = launch(nproc, run_overrides + ["packing=true", *overrides], tmp_path / layout, recipe=recipe(family))
    difference = assert_trains_like(run, reference, task, TOLERANCE)
    print(f"{family} {layout} {task} packed: largest loss difference {difference:.2e} over {len(run.losses)} steps")
    efficiency = run.summary["packing_efficiency"]
    assert 0 < efficiency <= 1 and efficiency == pytest.approx(1 - run.summary["padding_fraction"])
    assert "of the packed token slots held real tokens" in run.output

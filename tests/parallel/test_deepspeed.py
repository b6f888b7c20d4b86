"""engine=deepspeed: ZeRO 1/2/3 trains like one process, its config comes from the recipe, bad input is one line.

The parity rows launch 2 ranks as torchrun would (tiny models, real SST-2, 6 steps) and compare with the
single-process engine=torch run of test_parity; everything else starts no process (or one `--check`)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import RECIPE, SST2_ROWS, launch, recipe, tiny_overrides
from safetensors.torch import load_file
from test_cli import assert_one_line_error, check
from test_parity import _value

from parallel_finetune.errors import UserError
from parallel_finetune.parallel import deepspeed_engine
from parallel_finetune.parallel.deepspeed_engine import deepspeed_config
from parallel_finetune.preflight import preflight
from parallel_finetune.resolve import load_config

# Tolerances, from measured runs of these rows (tiny GPT-J, 6 steps, 2 ranks against 1 process):
# - fp32: the largest loss difference was 6.0e-8 for ZeRO 1, 2 and 3 alike, the largest relative gradient-norm
#   difference 8.6e-8 (float32 rounding: the same sums added in another order). 1e-5, as in test_parity, leaves
#   ~150x headroom and is still ~1000x below what a wrong gradient scale or a skipped rank moves.
# - bf16: DeepSpeed keeps bf16 weights (fp32 master copies in the optimizer) where engine=torch autocasts over
#   fp32 weights; both round to bf16's 8 significant bits (2^-9 = 0.2% relative per operation). Against the fp32
#   process, DeepSpeed bf16 differed by at most 5.6e-4 in loss and 0.20% in gradient norm, our own bf16 engine by
#   8.0e-4 and 0.19%. 5e-3 in loss (0.7% of a ~0.7 loss) and 1% in norm is ~6x the larger measured.
FP32 = {"loss": 1e-5, "norm": 1e-5, "weights": 1e-5}
BF16 = {"loss": 5e-3, "norm": 1e-2, "weights": None}  # weights: Adam's sign-like first steps amplify bf16 noise

# A user's JSON as the base: its stage and a setting no recipe key has; "auto" filled from the recipe.
USER_JSON = {
    "zero_optimization": {"stage": 2, "contiguous_gradients": False},
    "train_batch_size": "auto",
    "communication_data_type": "fp32",
}
ROWS = [
    # (id, family, overrides, tolerances)
    ("gptj-zero1-accumulation2", "gptj", ["zero_stage=1", "gradient_accumulation_steps=2"], FP32),
    ("gptj-zero2-user_json", "gptj", ["deepspeed_config=USER_JSON"], FP32),
    (
        "gptj-zero3-checkpointing-offload",
        "gptj",
        ["zero_stage=3", "activation_checkpointing=true", "offload_activations=true"],
        FP32,
    ),
    ("gptj-zero2-bf16", "gptj", ["zero_stage=2", "precision=bf16"], BF16),
    ("bert-zero3", "bert", ["zero_stage=3"], FP32),
]
# Both sides of these rows run AdamW with eps 1e-6. At the default 1e-8 an element whose gradient is of eps's size
# moves by up to lr x (its rounding error / eps): one embedding element of the tiny GPT-J differed by 1.06e-5 after
# 6 steps on an AVX-512 (bf16, no fp16) CPU while every other weight agreed to 2e-7 and the losses to 6e-8. With
# 1e-6 the largest weight difference of every row was 3.1e-7 there; the tolerances stay as they are.
ADAM = ("adam_eps=1e-6",)
SHARDED = 0.55  # of one process's bytes: half, plus padding


@pytest.mark.parametrize("family,overrides,tolerance", [pytest.param(*row[1:], id=row[0]) for row in ROWS])
def test_zero_matches_single_process(family, overrides, tolerance, single_process, sst2, cache_dir, tmp_path):
    reference = single_process(family, "classification", ADAM)
    (tmp_path / "user.json").write_text(json.dumps(USER_JSON))
    overrides = [o.replace("USER_JSON", str(tmp_path / "user.json")) for o in overrides]
    run = launch(
        2,
        tiny_overrides(sst2, cache_dir, family=family, export="true") + [*ADAM, "engine=deepspeed", *overrides],
        tmp_path / "run",
        recipe=recipe(family),
    )
    assert len(run.losses) == len(reference.losses) >= 5
    losses = [abs(a - b) for a, b in zip(run.losses, reference.losses)]
    assert max(losses) < tolerance["loss"], f"loss differences {losses}"
    assert reference.losses[0] != reference.losses[-1]  # the loss moves: equal trajectories prove something
    # AdamW is blind to a gradient's scale and clipping rescales anyway: gradients averaged instead of summed over
    # the ranks train the very same losses. The norm (before clipping) is what shows it.
    norms = [abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(run.records, reference.records)]
    assert max(norms) < tolerance["norm"], f"relative gradient-norm differences {norms}"
    assert all(r["loss_scale"] == 1 and not r["skipped"] for r in run.records)
    # Evaluation under ZeRO-3 too: every dev row scored once.
    summary = run.summary
    assert summary["accuracy"] == pytest.approx(reference.summary["accuracy"], abs=2 / SST2_ROWS["dev.tsv"])  # 2 rows
    assert summary["eval_loss"] == pytest.approx(reference.summary["eval_loss"], abs=tolerance["loss"])
    stage = int(_value(overrides, "zero_stage", "2"))
    assert (summary["engine"], summary["zero_stage"], summary["layout"]["data_parallel"]) == ("deepspeed", stage, 2)
    written = json.loads((run.output_dir / "deepspeed_config.json").read_text())
    accumulation = int(_value(overrides, "gradient_accumulation_steps", "1"))
    assert written["zero_optimization"]["stage"] == stage
    if "deepspeed_config" in " ".join(overrides):
        assert written["zero_optimization"] == USER_JSON["zero_optimization"]
        assert written["communication_data_type"] == "fp32"
    assert (written["train_batch_size"], written["train_micro_batch_size_per_gpu"]) == (16, 8 // accumulation)
    _check_state_bytes(
        stage, summary["precision"], summary["state_bytes_per_rank"], reference.summary["state_bytes_per_rank"][0]
    )
    # Export: the trained weights, gathered from DeepSpeed's fp32 partitions, under transformers' own names.
    exported = load_file(run.output_dir / "hf" / "model.safetensors")
    expected = load_file(reference.output_dir / "hf" / "model.safetensors")
    assert exported.keys() == expected.keys()
    assert all(exported[k].dtype == torch.float32 and exported[k].shape == expected[k].shape for k in expected)
    if tolerance["weights"] is not None:
        worst = max((exported[k] - expected[k]).abs().max().item() for k in expected)
        assert worst < tolerance["weights"], worst


def _check_state_bytes(stage: int, precision: str, per_rank: list[dict], single: dict) -> None:
    """ZeRO's promise per rank: AdamW state (and fp32 masters) sharded from stage 1, parameters from stage 3."""
    width = 0.5 if precision == "bf16" else 1.0  # DeepSpeed's bf16 model holds 2-byte parameters
    params = max(rank["params"] for rank in per_rank) / single["params"] / width
    optimizer = max(rank["optimizer"] for rank in per_rank) / single["optimizer"]
    master = max(rank["master_params"] for rank in per_rank) / single["params"]
    assert optimizer <= SHARDED and master <= SHARDED, (optimizer, master)
    assert params <= SHARDED if stage == 3 else params == 1.0, params


# ----------------------------------------------------------------------------------------------- the config
def tiny(*overrides: str):
    return load_config(RECIPE, ["size=tiny", "engine=deepspeed", *overrides])


def generate(config, dp: int, precision: str) -> dict:
    """The DeepSpeed config made from `config`'s training and parallel sections."""
    return deepspeed_config(training=config.training, parallel=config.parallel, dp=dp, precision=precision)


def test_config_from_the_recipe():
    config = tiny(
        "zero_stage=3",
        "batch_size=32",
        "gradient_accumulation_steps=2",
        "max_grad_norm=0.5",
        "lr=2e-4",
        "weight_decay=0.1",
        "adam_betas=[0.8, 0.99]",
        "adam_eps=1e-6",
    )
    assert config.tensor_parallel_degree == 1  # the recipe's `auto`: DeepSpeed runs data parallel only
    generated = generate(config, 4, "bf16")
    assert generated["train_batch_size"] == 32
    assert generated["train_micro_batch_size_per_gpu"] == 4  # 32 over 4 processes x 2 accumulation steps
    assert generated["gradient_accumulation_steps"] == 2
    assert generated["gradient_clipping"] == 0.5
    assert generated["zero_optimization"] == {"stage": 3}
    assert generated["bf16"] == {"enabled": True} and generated["fp16"] == {"enabled": False}
    assert generated["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 2e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1, "torch_adam": True},
    }
    assert "scheduler" not in generated  # the recipe's lr_scheduler runs in the trainer
    assert generate(tiny("max_grad_norm=null"), 2, "fp32")["gradient_clipping"] == 0.0
    assert generate(tiny(), 2, "fp32")["zero_optimization"]["stage"] == deepspeed_engine.DEFAULT_ZERO_STAGE
    assert generate(tiny("zero_stage=3", "mics_shard_size=2"), 4, "fp32")["zero_optimization"] == {
        "stage": 3,
        "mics_shard_size": 2,
    }


def test_fp16_section_is_dynamic_loss_scaling():
    generated = generate(tiny("initial_loss_scale=1024", "loss_scale_growth_interval=500"), 2, "fp16")
    # loss_scale 0 = dynamic; halve on every overflow (hysteresis 1) and double after 500 clean steps, as
    # engine=torch's own scaler does.
    assert generated["fp16"] == {
        "enabled": True,
        "initial_scale_power": 10,
        "loss_scale_window": 500,
        "loss_scale": 0,
        "hysteresis": 1,
        "min_loss_scale": 1,
    }
    assert generated["bf16"] == {"enabled": False}
    assert generate(tiny(), 2, "fp16")["fp16"]["initial_scale_power"] == 16  # the default 65536


def write(tmp_path, data) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def test_user_json_is_the_base(tmp_path):
    user = {
        "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_max_live_parameters": 1000},
        "train_batch_size": "auto",
        "gradient_clipping": 1.0,
        "communication_data_type": "fp32",
        "optimizer": {"params": {"torch_adam": False}},
    }
    generated = generate(tiny(f"deepspeed_config={write(tmp_path, user)}"), 2, "fp32")
    assert generated["zero_optimization"] == user["zero_optimization"]  # its stage: the recipe sets none
    assert generated["train_batch_size"] == 32  # "auto" is filled from the recipe's batch_size
    assert generated["communication_data_type"] == "fp32"  # what the recipe has no key for passes through
    assert generated["optimizer"]["params"]["torch_adam"] is False  # an engine default the user may change
    assert generated["optimizer"]["params"]["lr"] == 1e-3


@pytest.mark.parametrize(
    "user,overrides,message",
    [
        (
            {"train_batch_size": 64},
            [],
            "train_batch_size=64 conflicts with batch_size=32 (which means train_batch_size=32)",
        ),
        (
            {"zero_optimization": {"stage": 2}},
            ["zero_stage=3"],
            "zero_optimization.stage=2 conflicts with zero_stage=3",
        ),
        ({"gradient_clipping": 0.5}, [], "gradient_clipping=0.5 conflicts with max_grad_norm=1.0"),
        ({"bf16": {"enabled": True}}, ["precision=fp32"], "bf16.enabled=true conflicts with precision=fp32"),
        ({"optimizer": {"type": "Lamb"}}, [], 'optimizer.type="Lamb" conflicts with the trainer\'s optimizer (AdamW'),
        ({"optimizer": {"params": {"lr": 0.1}}}, [], "optimizer.params.lr=0.1 conflicts with lr=0.001"),
        ({"scheduler": {"type": "WarmupLR"}}, [], "has a 'scheduler' section, but the recipe's lr_scheduler='linear'"),
    ],
)
def test_user_json_conflicts_name_both(user, overrides, message, tmp_path):
    config = tiny(f"deepspeed_config={write(tmp_path, user)}", *overrides)
    with pytest.raises(UserError) as error:
        generate(config, 2, "fp32")
    assert message in str(error.value) and "ds.json" in str(error.value)
    assert "\n" not in str(error.value)


# ----------------------------------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["tensor_parallel_degree=2"], "engine=deepspeed with tensor_parallel_degree=2 is not supported"),
        (
            ["sharding=full"],
            "engine=deepspeed with sharding=full is not supported; DeepSpeed shards by zero_stage=1|2|3",
        ),
        (["sharding=optimizer"], "engine=deepspeed with sharding=optimizer is not supported"),
        (["zero_stage=4"], "zero_stage=4 is not valid; expected one of 1|2|3 or null"),
        (["engine=megatron"], "engine='megatron' is not valid; expected one of torch|deepspeed"),
        (["mics_shard_size=2"], "mics_shard_size=2 requires zero_stage=3, not zero_stage=2"),
        (["zero_stage=1", "mics_shard_size=2"], "mics_shard_size=2 requires zero_stage=3, not zero_stage=1"),
        (
            ["initial_loss_scale=1000"],
            "initial_loss_scale=1000 must be a power of two (DeepSpeed takes initial_scale_power), e.g. 1024",
        ),
        (["deepspeed_config=/no/such.json"], "deepspeed_config='/no/such.json': no such file"),
    ],
)
def test_bad_combinations_are_one_line_errors(overrides, message):
    with pytest.raises(UserError) as error:
        tiny(*overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("key", ["zero_stage=2", "mics_shard_size=2", "deepspeed_config=ds.json"])
def test_deepspeed_keys_need_the_engine(key):
    with pytest.raises(UserError, match=f"{key.split('=')[0]}=.* only applies to engine=deepspeed, not engine=torch"):
        load_config(RECIPE, ["size=tiny", key])


def test_bad_user_json(tmp_path):
    with pytest.raises(UserError, match=r"ds.json': not valid JSON \(Expecting"):
        tiny(f"deepspeed_config={write(tmp_path, '{stage: 3')}")
    with pytest.raises(UserError, match="must be a JSON object"):
        tiny(f"deepspeed_config={write(tmp_path, [1])}")


def test_mics(monkeypatch, sst2):
    # DeepSpeed 0.19.7 removed MiCS; the pinned 0.19.8 rejects zero_optimization.mics_shard_size with a traceback
    # on every rank. Ours is one line, at --check, pointing to the same scheme on engine=torch.
    config = tiny("zero_stage=3", "mics_shard_size=2", f"data_dir={sst2}")
    monkeypatch.setattr(deepspeed_engine, "deepspeed_version", lambda: (0, 19, 8))
    with pytest.raises(
        UserError,
        match=r"mics_shard_size=2: DeepSpeed 0.19.8 has no MiCS \(removed in 0.19.7.*"
        r"use engine=torch sharding=hybrid shard_group_size=2",
    ):
        preflight(config, 4)
    monkeypatch.setattr(deepspeed_engine, "deepspeed_version", lambda: (0, 19, 6))  # one that still had it
    assert "deepspeed ZeRO-3" in preflight(config, 4)
    with pytest.raises(UserError, match="mics_shard_size=2 does not divide the 3 data-parallel processes; valid: 1, 3"):
        preflight(tiny("zero_stage=3", "mics_shard_size=2", "batch_size=30", f"data_dir={sst2}"), 3)


NO_FP16 = pytest.mark.skipif(torch.ops.mkldnn._is_mkldnn_fp16_supported(), reason="this CPU has fp16 units")


@NO_FP16
def test_fp16_on_this_cpu_is_one_line_at_check(sst2):
    assert_one_line_error(
        check("size=tiny", f"data_dir={sst2}", "engine=deepspeed", "precision=fp16"),
        "engine=deepspeed: DeepSpeed refuses fp16 on this CPU (no fp16 arithmetic units); use "
        "precision=bf16 or precision=fp32, or run on a GPU",
    )


@NO_FP16
def test_fp16_on_this_cpu_is_one_line_from_two_ranks(sst2, cache_dir, tmp_path):
    run = launch(
        2, tiny_overrides(sst2, cache_dir) + ["engine=deepspeed", "precision=fp16"], tmp_path / "run", check=False
    )
    assert run.returncode != 0
    assert run.output.count("error: engine=deepspeed: DeepSpeed refuses fp16 on this CPU") == 1
    assert "Type fp16 is not supported" not in run.output  # DeepSpeed's own traceback never comes
    assert not (tmp_path / "run").exists()  # refused before the run folder appears


def test_deepspeed_is_imported_only_for_its_engine(sst2):
    if "deepspeed" in sys.modules:
        pytest.skip("an earlier test in this process imported deepspeed")
    from parallel_finetune.loop import trainer  # noqa: F401

    assert "ok:" in preflight(tiny("zero_stage=3", f"data_dir={sst2}"), 2)  # config, JSON and checks: no import
    assert "deepspeed" not in sys.modules

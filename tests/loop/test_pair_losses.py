"""The pair losses (loop/pair_losses.py) against hand-computed values (TRL's CPOTrainer loss_type=simpo and
ORPOTrainer formulas, written out with the math module), PreferenceLoss's ORPO NLL as a token mean over the batch's
chosen rows (prompt tokens included, as TRL's), and the config's one-line refusals of one loss's keys on another."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO

from parallel_finetune.errors import UserError
from parallel_finetune.loop.pair_losses import DPOLoss, ORPOLoss, SimPOLoss, pair_loss_for
from parallel_finetune.resolve import load_config

LOGPS = torch.tensor([[-6.0, -9.0], [-4.0, -2.5]])  # summed over each answer's tokens: (chosen, rejected)
TOKENS = torch.tensor([[3.0, 4.0], [2.0, 5.0]])


def logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def test_simpo_is_trls_cpo_simpo_loss():
    beta, gamma, s = 2.0, 0.5, 0.1
    losses, stats = SimPOLoss(beta, gamma, s)(LOGPS, TOKENS, None)
    for pair, ((c, r), (nc, nr)) in enumerate(zip(LOGPS.tolist(), TOKENS.tolist())):
        logits = (c / nc - r / nr) - gamma / beta  # TRL: gamma_logratios = simpo_gamma / beta
        expected = -logsigmoid(beta * logits) * (1 - s) - logsigmoid(-beta * logits) * s
        assert losses[pair].item() == pytest.approx(expected, abs=1e-6)
        assert stats["rewards/chosen"][pair].item() == pytest.approx(beta * c / nc)
        assert stats["rewards/rejected"][pair].item() == pytest.approx(beta * r / nr)
        assert stats["rewards/margins"][pair].item() == pytest.approx(beta * (c / nc - r / nr))
        assert stats["logps/chosen"][pair].item() == pytest.approx(c / nc)
        assert stats["logps/rejected"][pair].item() == pytest.approx(r / nr)
    # pair 0: -2 > -2.25 (chosen ahead), pair 1: -2 < -0.5
    assert stats["rewards/accuracies"].tolist() == [1.0, 0.0]
    assert not SimPOLoss.needs_reference and set(SimPOLoss.metric_names) == set(stats)


def test_orpo_is_trls_odds_ratio_loss():
    beta = 0.25
    chosen_nll = torch.tensor([1.5, 0.75])  # each pair's share of the batch's token-mean NLL
    losses, stats = ORPOLoss(beta)(LOGPS, TOKENS, None, chosen_nll)
    for pair, ((c, r), (nc, nr)) in enumerate(zip(LOGPS.tolist(), TOKENS.tolist())):
        a, b = c / nc, r / nr
        log_odds = (a - b) - (math.log1p(-math.exp(a)) - math.log1p(-math.exp(b)))
        ratio = logsigmoid(log_odds)
        assert losses[pair].item() == pytest.approx(chosen_nll[pair].item() - beta * ratio, abs=1e-6)
        assert stats["log_odds_chosen"][pair].item() == pytest.approx(log_odds, abs=1e-6)
        assert stats["log_odds_ratio"][pair].item() == pytest.approx(ratio, abs=1e-6)
        assert stats["nll_loss"][pair].item() == chosen_nll[pair].item()
        assert stats["rewards/chosen"][pair].item() == pytest.approx(beta * a)
        assert stats["logps/rejected"][pair].item() == pytest.approx(b)
    assert not ORPOLoss.needs_reference and ORPOLoss.chosen_sequence_nll
    assert set(ORPOLoss.metric_names) == set(stats)


def test_orpo_log1mexp_is_finite_near_zero():
    """An answer the model is nearly sure of (mean log-probability -1e-9): log(1 - e^a) by expm1, finite."""
    losses, stats = ORPOLoss(0.1)(torch.tensor([[-1e-9, -3.0]]), torch.ones(1, 2), None, torch.zeros(1))
    assert torch.isfinite(losses).all() and stats["log_odds_chosen"].item() > 15


def test_dpo_keeps_its_formulas():
    """The DPO family moved into DPOLoss unchanged: sigmoid against the reference, ipo on averages."""
    reference = torch.tensor([[-5.0, -8.0], [-4.5, -2.0]])
    losses, stats = DPOLoss("sigmoid", 0.1)(LOGPS, TOKENS, reference)
    d = (LOGPS[:, 0] - LOGPS[:, 1]) - (reference[:, 0] - reference[:, 1])
    assert torch.allclose(losses, -torch.nn.functional.logsigmoid(0.1 * d))
    assert torch.allclose(stats["rewards/chosen"], 0.1 * (LOGPS[:, 0] - reference[:, 0]))
    losses, _ = DPOLoss("ipo", 0.1)(LOGPS, TOKENS, reference)
    d = (LOGPS[:, 0] - reference[:, 0]) / TOKENS[:, 0] - (LOGPS[:, 1] - reference[:, 1]) / TOKENS[:, 1]
    assert torch.allclose(losses, (d - 5) ** 2)


def test_preference_loss_orpo_nll_is_the_batch_token_mean_of_the_chosen_rows():
    """PreferenceLoss with no head (engine=deepspeed's path: whole logits): ORPO's nll_loss over the pairs is the
    chosen rows' NLL (prompt tokens, marked -(answer + 2), and answer tokens) over their token count, as TRL's
    cross-entropy over the batch's chosen rows; the rejected rows' prompts are not scored."""
    from parallel_finetune.loop.loss import PreferenceLoss

    preference = SimpleNamespace(dpo_loss="orpo", dpo_beta=0.1)
    loss = PreferenceLoss(None, 0, preference=preference)
    torch.manual_seed(0)
    # pair 0: chosen prompt 2 + answer 3 tokens, rejected answer 2; pair 1: chosen prompt 1 + answer 1, rejected 3
    answers = [-2, -2, 0, 0, 0, 1, 1, -4, 2, 3, 3, 3]
    labels = torch.randint(0, 7, (len(answers),))
    logits = torch.randn(len(answers), 7)
    target = torch.stack([labels.double(), torch.tensor(answers).double(), torch.zeros(len(answers))], -1)
    # the split's chosen rows: 6 and 3 tokens (5 and 2 scored: every token but the first)
    loss.share_of(SimpleNamespace(ids=[[0] * 6, [0] * 3]), [0, 1])
    total, stats = loss(logits, target)  # the loss and its per-pair statistics, from the one call
    nll = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    chosen = torch.tensor([a in (-2, 0, -4, 2) for a in answers])
    assert stats["nll_loss"].sum().item() / 2 == pytest.approx(nll[chosen].mean().item(), abs=1e-6)
    assert stats["answer_tokens"].tolist() == [[3.0, 2.0], [1.0, 3.0]]
    assert torch.allclose(stats["answer_logps"][:, 0], -torch.stack([nll[2:5].sum(), nll[8:9].sum()]))
    assert total.item() == pytest.approx(stats["loss"].sum().item())
    # the metrics are the statistics' means over the pairs, in metric_names order, whatever calls they came from
    halves = [{name: values[pair : pair + 1] for name, values in stats.items()} for pair in (0, 1)]
    totals = loss.sums(halves, "cpu")
    assert totals[-1].item() == 2 and torch.equal(totals, loss.sums([stats], "cpu"))
    metrics = loss.metrics(totals)
    assert list(metrics) == list(loss.metric_names) and metrics["loss"] == pytest.approx(total.item() / 2)


@pytest.mark.parametrize(
    "overrides,says",
    [
        (["dpo_loss=kto"], "dpo_loss='kto' is not valid; expected one of sigmoid|ipo|hinge|robust|simpo|orpo"),
        (["simpo_gamma=1"], "simpo_gamma=1.0 is dpo_loss=simpo's target margin, and dpo_loss=sigmoid reads none"),
        (["dpo_loss=orpo", "rpo_alpha=1"], "rpo_alpha=1.0 is the DPO family's SFT term, and dpo_loss=orpo"),
        (["dpo_loss=simpo", "dpo_length_normalized=true"], "dpo_length_normalized=True is the DPO family's"),
        (
            ["dpo_loss=orpo", "dpo_label_smoothing=0.1"],
            "is read by dpo_loss=sigmoid (cDPO), robust and simpo, not orpo",
        ),
    ],
)
def test_one_pair_losss_keys_on_another_are_refused_in_one_line(overrides, says):
    with pytest.raises(UserError) as caught:
        load_config(REPO / "recipes" / "llama" / "tp.yaml", ["task=dpo", *overrides])
    message = str(caught.value)
    assert says in message and "\n" not in message, message


def test_the_section_picks_the_pair_loss():
    section = SimpleNamespace(
        dpo_loss="simpo", dpo_beta=2.0, simpo_gamma=0.4, dpo_label_smoothing=0.0, rpo_alpha=0, dpo_length_normalized=0
    )
    simpo = pair_loss_for(section)
    assert isinstance(simpo, SimPOLoss) and (simpo.beta, simpo.gamma) == (2.0, 0.4)
    assert isinstance(pair_loss_for(SimpleNamespace(**{**vars(section), "dpo_loss": "orpo"})), ORPOLoss)
    dpo = pair_loss_for(SimpleNamespace(**{**vars(section), "dpo_loss": "robust"}))
    assert isinstance(dpo, DPOLoss) and dpo.needs_reference and dpo.kind == "robust"


def test_orpos_unslashed_metrics_reach_the_trackers():
    """TRL names ORPO's nll_loss, log_odds_ratio and log_odds_chosen without a "/": the trackers get them too."""
    from parallel_finetune.outputs.loggers import _scalars

    step = {"loss": 1.0, "rewards/chosen": -0.5} | {name: 0.25 for name in ORPOLoss.metric_names[-3:]}
    assert set(_scalars(step)) == {f"train/{name}" for name in step}

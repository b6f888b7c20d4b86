"""The language model's loss from hidden states (loop/loss.py, parallel/vocab.py): the chunked head and
cross-entropy equal the whole logits' loss and gradients, never allocate a tokens x vocabulary tensor, and the
runner's hidden-state path (the head replaced for one forward) equals the model's own logits."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_trains_like, recipe, tiny_overrides
from torch import nn

from parallel_finetune.data.batch import IGNORE, padded_batch
from parallel_finetune.loop.loss import TOKEN_OBJECTIVE, HiddenTokenLoss
from parallel_finetune.loop.runner import WholeModel
from parallel_finetune.parallel.vocab import token_nll
from parallel_finetune.tasks.task import HeadKind


def reference(hidden, weight, bias, labels, softcap=None, temperature=1.0):
    logits = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits / temperature, labels, reduction="none")  # TRL's order: capped, then tempered


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize(
    "bias,softcap,temperature",
    [(False, None, 1.0), (True, None, 1.0), (False, 5.0, 1.0), (True, None, 0.7), (False, 5.0, 1.3)],
)
def test_chunked_nll_equals_whole_logits_and_its_gradients(chunk, bias, softcap, temperature):
    """Also under a sampling temperature (task=grpo scores the tempered distribution: the capped logits x scale)."""
    torch.manual_seed(0)
    rows, hidden_size, vocab = 53, 16, 97
    hidden = torch.randn(rows, hidden_size, requires_grad=True)
    head = nn.Linear(hidden_size, vocab, bias=bias)
    labels = torch.randint(0, vocab, (rows,))
    weights = torch.rand(rows)  # a per-token weight, as a preference loss gives
    got = token_nll(hidden, head, labels, chunk, softcap, 1 / temperature)
    (got * weights).sum().backward()
    grads = hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone() if bias else None
    hidden.grad, head.weight.grad = None, None
    if bias:
        head.bias.grad = None
    expected = reference(hidden, head.weight, head.bias, labels, softcap, temperature)
    (expected * weights).sum().backward()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[1], head.weight.grad, atol=1e-5, rtol=1e-5)
    if bias:
        torch.testing.assert_close(grads[2], head.bias.grad, atol=1e-5, rtol=1e-5)


def test_the_hidden_loss_never_allocates_tokens_times_vocabulary():
    """A vocabulary of 128,256 (Llama 3's) and 2,048 target tokens: the whole logits would be 1.05 GB in fp32; the
    chunked loss's largest allocation, forward and backward, is one chunk's logits (256 x 128,256 x 4 B)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    rows, hidden_size, vocab, chunk = 2048, 32, 128256, 256
    hidden = torch.randn(rows, hidden_size, requires_grad=True)
    head = nn.Linear(hidden_size, vocab, bias=False)
    labels = torch.randint(0, vocab, (rows,))
    loss = HiddenTokenLoss(head, chunk)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss(hidden, labels)[0].backward()
    largest = max(event.cpu_memory_usage for event in prof.events() if event.cpu_memory_usage > 0)
    whole = rows * vocab * 4
    assert largest <= chunk * vocab * 4 * 1.01, (largest, whole)
    assert largest < whole / 7


def tiny_llama():
    from parallel_finetune.families import get_family

    family = get_family("llama")
    config = family.sized_config(120, 64, 32, 2, 2)
    family.set_task(config, HeadKind.CAUSAL_LM, 0)
    torch.manual_seed(0)
    return family.hf_model(HeadKind.CAUSAL_LM, config).eval()


def test_the_runner_hidden_path_equals_the_models_logits():
    """WholeModel with a HiddenTokenLoss: the model's own forward with its head replaced for the one call (the
    labelled positions only reach the loss) gives the loss and gradients of its whole logits; the head is the
    model's again afterwards, and generation's last-token logits are those of the whole forward."""
    rows = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
    batch = padded_batch(rows, pad_id=0)
    from parallel_finetune.data.batch import next_token_labels

    batch.labels = next_token_labels(batch.input_ids, batch.attention_mask)
    results = []
    for chunked in (False, True):
        model = tiny_llama()
        head = model.get_output_embeddings()
        loss = HiddenTokenLoss(head, 2) if chunked else TOKEN_OBJECTIVE
        runner = WholeModel(model, HeadKind.CAUSAL_LM, loss, contextlib.nullcontext, None, False, torch.device("cpu"))
        value, stats = runner.summed_loss(batch)
        assert stats == {}  # a language model's loss keeps no statistics
        value.backward()
        assert model.get_output_embeddings() is head
        results.append((value.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        last = runner.last_logits(batch)
        whole = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        ends = [len(row) - 1 for row in rows]
        torch.testing.assert_close(last, whole[torch.arange(3), ends], atol=1e-5, rtol=1e-5)
    (plain, plain_grads), (chunked, chunked_grads) = results
    assert abs(plain.item() - chunked.item()) < 1e-5
    for name, grad in plain_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, atol=1e-5, rtol=1e-5)
    assert IGNORE in batch.labels  # padding and the rows' ends were labelled IGNORE and skipped


# ---------------------------------------------------------------- runs: the chunked loss against today's
WHOLE_LOGITS = [
    pytest.param("causal_lm", [], id="causal_lm"),
    pytest.param("sft", [], id="sft"),
    pytest.param("sft", ["packing=true"], id="sft-packed"),
]


@pytest.mark.parametrize("task,extra", WHOLE_LOGITS)
def test_the_chunked_loss_trains_like_the_whole_logits(task, extra, single_process_run, sst2, cache_dir):
    """One process, the same rows: the loss from hidden states in chunks of 48 tokens (the parity rows' reference,
    test_parity's) against loss_chunk_tokens=0, the model's own whole logits as before; every step's loss, the
    eval loss and perplexity within 1e-5, and sft's generations (greedy, through the same head) the same."""
    if task == "sft":
        from test_chat import sft_run_overrides

        overrides = sft_run_overrides(sst2, cache_dir, "llama", generate_every=3, generate_prompts=2) + extra
    else:
        overrides = tiny_overrides(sst2, cache_dir, task, "llama") + extra
    chunked = single_process_run(recipe("llama"), overrides)
    whole = single_process_run(recipe("llama"), [*overrides, "loss_chunk_tokens=0"])
    difference = assert_trains_like(chunked, whole, task)
    print(f"llama {task} {extra}: chunked vs whole logits, largest loss difference {difference:.2e}")
    if task == "sft":
        answers = [
            (chunked.output_dir / "generations.jsonl").read_text(),
            (whole.output_dir / "generations.jsonl").read_text(),
        ]
        assert answers[0] == answers[1] and answers[0]

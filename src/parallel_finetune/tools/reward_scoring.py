"""predict.py with a reward model (task=reward): a file of preference pairs in task=dpo's formats (prompt, chosen,
rejected; or chosen and rejected sharing their prompt; texts or messages) scored as training scored them. Each
pair's rows are tokenized as the run tokenized them (data/reward.py, the exported tokenizer's chat template), and
the one-output classifier's score of each row read: printed as index<TAB>chosen<TAB>rejected<TAB>preferred (which
answer scores higher). A margin column, if any, is not read. Bad rows are one line naming file:line, as in training.
"""

from __future__ import annotations

from ..tasks.files import Table

HEADER = "index\tchosen\trejected\tpreferred"


def score_pairs(classifier, table: Table, batch_size: int = 32) -> list[tuple[float, float]]:
    """(chosen score, rejected score) of each pair of `table`, in file order."""
    import datasets
    import torch

    from ..config import DataSection
    from ..data.batch import padded_batch
    from ..data.reward import tokenize_reward_pairs
    from ..tasks.preferences import detect_preference_format, preference_rows

    form, columns = detect_preference_format(table, data=DataSection())
    rows = preference_rows(table, "test", form, columns)
    pairs = tokenize_reward_pairs(datasets.Dataset.from_dict(rows), classifier.tokenizer, classifier.max_length, "FILE")
    ids = [row for pair in zip(pairs["input_ids"], pairs["rejected_ids"]) for row in pair]
    tokenizer, scores = classifier.tokenizer, []
    for start in range(0, len(ids), 2 * batch_size):
        batch = padded_batch(
            ids[start : start + 2 * batch_size], pad_id=tokenizer.pad_token_id, padding_side=tokenizer.padding_side
        ).to(classifier.device)
        with torch.no_grad():
            logits = classifier.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        scores.extend(logits.float()[:, 0].tolist())
    return list(zip(scores[::2], scores[1::2]))


def pair_lines(scores: list[tuple[float, float]]) -> list[str]:
    """HEADER, then one line per pair: its index in the file, both scores, the answer that scores higher."""
    lines = [HEADER]
    for index, (chosen, rejected) in enumerate(scores):
        preferred = "chosen" if chosen > rejected else "rejected" if rejected > chosen else "tie"
        lines.append(f"{index}\t{chosen:.4f}\t{rejected:.4f}\t{preferred}")
    return lines

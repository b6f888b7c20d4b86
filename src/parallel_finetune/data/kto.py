"""task=kto's tokens and batches: each row a prompt and a completion, labelled desirable or undesirable.

Tokens are made as TRL's KTOTrainer makes them: the prompt alone (a conversation rendered with the generation
prompt, or the text with the tokenizer's own special tokens) and the prompt with the completion (a text
completion with EOS appended); the prompt's tokens are those both begin with (TRL's common_prefix_length), the
rest is the completion, which alone is scored. A prompt is never cut (one that leaves no token for its completion
is an error naming the row); a row longer than max_length loses its completion's end, as TRL's collator cuts it.
Each row keeps its whole completion (`completion_ids`) for the KL rows.

KL rows (TRL's KL estimate): a step's global batch, rows b_0 .. b_{n-1} in the sampler's order, is paired with
mismatched completions as TRL rotates each batch: row b_j's prompt with row b_{j-1}'s completion (b_0's with
b_{n-1}'s), the prompt's tokens then the completion's, cut to max_length (`kl_pairs`, `KTOBatcher.kl_batch`).
The held-out split's KL rows are its rows in order, rotated alike.

Batches (KTOBatcher): the preference batcher's padded rows (data/batch.py), one row per index, its answer number
2r for a desirable row r of the batch and 2r + 1 for an undesirable one (so the loss tells them apart), with the
row's reference log-probability (KTOReference, measured before training: loop/reference.py over the units the
batcher names, rows and KL rows). Never packed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import datasets

from ..errors import UserError
from .batch import Batch, PreferenceBatcher, TokenizedSplit
from .chat import render_failure
from .preference import answer_text, prompt_text, shared_length
from .sampling import token_slots

log = logging.getLogger(__name__)


def tokenize_kto(split: datasets.Dataset, tokenizer, max_length: int, desc: str) -> datasets.Dataset:
    """Each row's `input_ids` (prompt and completion, cut to max_length), `completion_ids` (the whole completion),
    `prompt_length`, `desirable` (its label), `length` and `index`."""
    columns: dict[str, list] = {name: [] for name in ("input_ids", "completion_ids", "prompt_length", "desirable")}
    columns |= {"length": [], "index": []}
    cut = 0
    rows = zip(split["prompt"][:], split["completion"][:], split["label"][:], split["where"][:], split["index"][:])
    for prompt, completion, label, where, index in rows:
        prompt, completion = json.loads(prompt), json.loads(completion)
        try:
            asked = prompt_text(tokenizer, prompt)
            answer = answer_text(tokenizer, prompt, asked, completion, where, "completion")
        except UserError:
            raise
        except Exception as exc:  # jinja2's render errors, a template's raise_exception on this conversation
            raise render_failure(where, "row", exc) from None
        specials = isinstance(completion, str)  # a rendered conversation holds the template's own special tokens
        whole = tokenizer(asked + answer, add_special_tokens=specials)["input_ids"]
        prompt_length = shared_length(tokenizer(asked, add_special_tokens=specials)["input_ids"], whole)
        if not prompt_length:
            raise UserError(f"{where}: the prompt is no token; a completion follows a prompt")
        if prompt_length >= max_length:
            raise UserError(
                f"{where}: the prompt is {prompt_length} tokens, which leaves no room for the completion within "
                f"max_length={max_length} (prompts are never cut; completions are cut at the end to fit); raise "
                "max_length or shorten the prompt"
            )
        if len(whole) == prompt_length:
            raise UserError(f"{where}: the completion renders to no token")
        cut += len(whole) > max_length
        columns["input_ids"].append(whole[:max_length])
        columns["completion_ids"].append(whole[prompt_length:])
        columns["prompt_length"].append(prompt_length)
        columns["desirable"].append(bool(label))
        columns["length"].append(min(len(whole), max_length))
        columns["index"].append(index)
    if cut:
        log.warning(
            "kto %s split: cut the completions of %d of %d row(s) to max_length=%d (their end is lost)",
            *(desc, cut, len(columns["index"]), max_length),
        )
    return datasets.Dataset.from_dict(columns)


def kl_pairs(rows) -> list[tuple[int, int]]:
    """TRL's mismatched pairs of `rows` (a global batch in the sampler's order, or a held-out split's rows):
    (row j's prompt, row j - 1's completion), the first row's with the last row's completion."""
    rows = list(rows)
    return [(rows[j], rows[j - 1]) for j in range(len(rows))]


def kl_key(ids: list[int]) -> int:
    """What a KL row's reference log-probability is found by: its tokens (a row of the same tokens has the same)."""
    return hash(tuple(ids))


@dataclass(frozen=True)
class KTOReference:
    """A split's reference log-probabilities, measured before training (loop/reference.py): each measured row's summed
    over its completion, and each measured KL row's by kl_key. A row or KL row not measured is refused, not 0."""

    rows: list[float]
    measured: list[bool]
    kl: dict[int, float]

    def of(self, row: int) -> float:
        if not self.measured[row]:
            raise RuntimeError(f"row {row}'s reference log-probability was not measured before training")
        return self.rows[row]


class KTOBatcher(PreferenceBatcher):
    """Batches of KTO rows, padded (never packed): row r of a batch's `indices` labelled on its completion's tokens,
    answer number 2r (desirable) or 2r + 1 (undesirable), with its reference log-probability.

    The reference pass's and the KL estimate's units (loop/reference.py): a row (its index) or a KL row (a pair of
    indices from `kl_pairs`: one row's prompt, another's completion, cut to `max_length`), one value each; a batch
    of units (`units_batch`) numbers them 2r, their reference 0 (neither pass reads the loss)."""

    reference_width = 1  # one answer a unit

    def __init__(self, split: TokenizedSplit, *, reference: KTOReference | None = None, max_length: int = 0, **padding):
        """`max_length`: what KL rows are cut to (0: this batcher makes none)."""
        super().__init__(split, **padding)
        self.max_length, self.kto_reference = max_length, reference

    def _rows(self, indices: list[int]) -> list[tuple[list[int], int, int, float]]:
        split, reference = self.split, self.kto_reference
        return [
            (
                split.ids[i],
                split.prompt_lengths[i],
                2 * n + (not split.desirable[i]),
                reference.of(i) if reference else 0,
            )
            for n, i in enumerate(indices)
        ]

    def kl_ids(self, prompt_row: int, completion_row: int) -> tuple[list[int], int]:
        """A KL row's tokens (one row's prompt, another's completion, cut to max_length) and its prompt length."""
        if not self.max_length:
            raise RuntimeError("this KTOBatcher makes no KL rows (max_length=0)")
        split = self.split
        prompt = split.ids[prompt_row][: split.prompt_lengths[prompt_row]]
        return (prompt + split.completion_ids[completion_row])[: self.max_length], len(prompt)

    def _unit(self, unit) -> tuple[list[int], int]:
        """A unit's tokens and prompt length: a row's own, or a KL row's."""
        if isinstance(unit, tuple):
            return self.kl_ids(*unit)
        return self.split.ids[unit], self.split.prompt_lengths[unit]

    def reference_units(self, batches: list[list[int]]) -> list:
        """What the reference pass measures of the global batches `batches` (a run's steps', or a held-out split
        whole as one): their rows, then each batch's KL rows (one of the same tokens once)."""
        rows = sorted({i for batch in batches for i in batch})
        kl: dict[int, tuple[int, int]] = {}
        for batch in batches:
            for pair in self.kl_units(batch):
                kl.setdefault(kl_key(self.kl_ids(*pair)[0]), pair)
        return rows + list(kl.values())

    def kl_units(self, rows) -> list[tuple[int, int]]:
        """The KL rows of a global batch `rows` (TRL's rotation: kl_pairs)."""
        return kl_pairs(rows)

    def unit_keys(self, units: list) -> list[int]:
        """The KL rows' keys (kl_key) in a KTOReference."""
        return [kl_key(self.kl_ids(*unit)[0]) for unit in units]

    def unit_lengths(self, units: list) -> list[int]:
        return [len(self._unit(unit)[0]) for unit in units]

    def units_batch(self, units: list) -> Batch:
        return self.rows_batch([(*self._unit(unit), 2 * n, 0.0) for n, unit in enumerate(units)])

    def reference_of(self, units: list, values: list[list[float]]) -> KTOReference:
        """The KTOReference of the measured `units` (`values`: one list of reference_width values each)."""
        measured, per_row, kl = [False] * len(self.split), [0.0] * len(self.split), {}
        for unit, (value,) in zip(units, values):
            if isinstance(unit, tuple):
                kl[kl_key(self.kl_ids(*unit)[0])] = value
            else:
                measured[unit], per_row[unit] = True, value
        return KTOReference(per_row, measured, kl)

    def sequence_lengths(self, indices: list[int]) -> list[int]:
        return [self.split.lengths[i] for i in indices]

    def token_slots(self, global_batch: list[int], dp: int, accumulation: int) -> int:
        return token_slots(global_batch, self.split.lengths, dp, accumulation, self.pad_multiple)

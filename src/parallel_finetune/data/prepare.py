"""A task's rows to padded batches: tokenize (single texts, pairs, or language-model blocks), cache, sample, collate.

Where rows come from and what their labels mean is tasks/'s business (`load_task`); this module turns the result
into token ids once, caches them keyed by the rows, the task and the tokenizer, and batches them. Batches are
padded per batch, never to a fixed length: SST-2 sentences average ~10 words.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import datasets
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ..config import DataSection, ModelSection, TrainingSection
from ..errors import UserError
from ..families.base import Family
from ..model.hub import resolve_model_path
from ..model.pretrained import load_hf_tokenizer
from ..outputs.runfolder import check_writable
from ..tasks import HeadKind, Source, Task, load_task, read_label_file, write_label_file
from ..tasks.conversations import ROLES
from ..tasks.files import MAX_DATA_FILE_BYTES, MAX_ROW_CHARS, MAX_WORD_CHARS  # noqa: F401  (re-exported bounds)
from . import chat, kto, preference, prompts, reward

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"


def load_raw(
    *, data: DataSection, model: ModelSection, seed: int, predict: bool
) -> tuple[datasets.DatasetDict, Task, Source]:
    """The run's splits (columns text[, text_pair][, label], index), its Task and where the rows came from."""
    return load_task(data=data, model=model, seed=seed, predict=predict)


def read_glue_dir(data_dir: str | Path, glue_task: str = "sst2") -> datasets.DatasetDict:
    """A GLUE task's folder as splits (columns text[, text_pair], label, index): for scripts and tests that want
    the sentences (every other key at its default)."""
    section = DataSection(glue_task=glue_task, data_dir=str(data_dir))
    return load_task(data=section, model=ModelSection(), seed=TrainingSection().seed, predict=False)[0]


# ----------------------------------------------------------------------------------------------- tokenizer


# The special tokens a tokenizer's wrapper names; which vocabulary entry plays each part is set in
# tokenizer_config.json, not in the vocabulary, so the cache key must name them itself.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of everything that decides token ids, for cache keys: the vocabulary and its pipeline (merges,
    normalizer, post-processor, added tokens), the special tokens the data code inserts (EOS between causal-LM
    rows and between the texts of a pair, BOS, padding) with their ids, the sides, and the chat template."""
    state = (
        tokenizer.backend_tokenizer.to_str() if tokenizer.is_fast else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    )
    digest = hashlib.sha256(state.encode())
    specials = {name: [getattr(tokenizer, name), getattr(tokenizer, f"{name}_id")] for name in SPECIAL_TOKENS}
    decided = {
        "specials": specials,
        "padding_side": tokenizer.padding_side,
        "truncation_side": tokenizer.truncation_side,
        # slow (and some fast) tokenizers add BOS/EOS by flags rather than by their post-processor
        "add_bos_token": getattr(tokenizer, "add_bos_token", None),
        "add_eos_token": getattr(tokenizer, "add_eos_token", None),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    digest.update(json.dumps(decided, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class TinyTokenizer:
    """What a tiny model's tokenizer learns: its kind (the family's: "bpe" or "wordpiece"), its vocabulary size,
    and the control tokens a chat template writes (task=sft), kept whole as special tokens."""

    kind: str
    vocab_size: int
    specials: tuple[str, ...] = ()


def train_tokenizer(
    kind: str, sentences: list[str], vocab_size: int, folder: Path, specials: tuple[str, ...] = ()
) -> PreTrainedTokenizerFast:
    """A tokenizer learned from the training sentences, so tiny models run without the Hub: byte-level BPE for
    the GPT families, lower-cased WordPiece with [CLS] ... [SEP] for BERT; `specials` (a chat template's control
    tokens) are added special tokens, never split or merged."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if kind == "bpe":
        raw = Tokenizer(models.BPE())
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        raw.decoder = decoders.ByteLevel()
        raw.train_from_iterator(
            sentences,
            trainers.BpeTrainer(
                vocab_size=vocab_size,
                min_frequency=2,
                special_tokens=[EOS],
                show_progress=False,
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            ),
        )
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=raw, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=EOS, padding_side="right"
        )
        if specials:
            tokenizer.add_special_tokens({"additional_special_tokens": list(specials)})
    else:
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        raw = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        raw.normalizer = normalizers.BertNormalizer(lowercase=True)
        raw.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        raw.decoder = decoders.WordPiece()
        raw.train_from_iterator(
            sentences, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
        )
        cls, sep = raw.token_to_id("[CLS]"), raw.token_to_id("[SEP]")
        raw.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
        )
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=raw,
            pad_token="[PAD]",
            unk_token="[UNK]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
            padding_side="right",
        )
    _save_atomically(folder, tokenizer.save_pretrained)
    # What the folder holds, not what this process learned: the trainers order equally frequent pieces differently
    # from process to process, so of two runs learning at once (one cache_dir) the one whose save lost the race
    # would otherwise train on another vocabulary than every later run loads.
    return load_hf_tokenizer(folder)


def load_tokenizer(
    name: str | None,
    size: str,
    model_name: str,
    tiny: TinyTokenizer,
    train_sentences: list[str],
    source: Source,
    cache_dir: Path,
) -> PreTrainedTokenizerFast:
    if name is None and size == "tiny":
        # "-pairs": the WordPiece template encodes sentence pairs too (folders without it predate pair tasks). The
        # sentences' digest: tasks reading one source learn from different texts or orders (kto's unpaired rows, a
        # reward model's pairs), and a learned vocabulary depends on both; one folder per source let whichever
        # task ran first decide the other's tokenizer.
        learned = hashlib.sha256("\0".join(train_sentences).encode()).hexdigest()[:8]
        folder = cache_dir / "tokenizers" / f"{tiny.kind}{tiny.vocab_size}-pairs-{source.fingerprint}-{learned}"
        if tiny.specials:  # a chat template's control tokens
            folder = folder.with_name(
                folder.name + "-" + hashlib.sha256("|".join(tiny.specials).encode()).hexdigest()[:8]
            )
        if folder.is_dir():
            return load_hf_tokenizer(folder)
        log.info(
            "training a %s tokenizer (vocab %d) on %d sentences -> %s",
            tiny.kind,
            tiny.vocab_size,
            len(train_sentences),
            folder,
        )
        return train_tokenizer(tiny.kind, train_sentences, tiny.vocab_size, folder, tiny.specials)
    where = name or model_name
    try:
        tokenizer = load_hf_tokenizer(resolve_model_path(where))
    except UserError:
        raise
    except Exception as exc:
        raise UserError(
            f"tokenizer {where!r}: cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        ) from None
    if tokenizer.eos_token is None:
        take_eos_from_model_config(tokenizer, where, model_name)
    if tokenizer.pad_token is None:
        # GPT tokenizers have no pad token; padding positions are masked out, so any id works, EOS is customary.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def take_eos_from_model_config(tokenizer, *folders: str) -> None:
    """A tokenizer whose files name no EOS token takes the one the model's config.json names (`eos_token_id`, the
    first of a list), as generation would, and says so; without one it stays None (check_inserted_tokens)."""
    for folder in dict.fromkeys(folders):
        config_file = Path(resolve_model_path(folder)) / "config.json"
        if not config_file.is_file():
            continue
        try:
            eos = json.loads(config_file.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue  # the model's own load reports an unreadable config in one line
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < len(tokenizer):
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
            log.info(
                "the tokenizer names no EOS token: using %r (id %d), the eos_token_id of %s",
                tokenizer.eos_token,
                eos,
                config_file,
            )
            return


def check_inserted_tokens(tokenizer, where: str, causal_lm: bool, joined_pairs: bool) -> None:
    """The tokens the data code inserts exist: EOS between causal-LM rows and between the two texts of a pair (GPT
    families), and a padding token for every batch (EOS stands in for a missing one)."""
    needs = "task=causal_lm puts it between rows" if causal_lm else "sentence pairs are joined with it"
    if tokenizer.eos_token_id is None and (causal_lm or joined_pairs):
        raise UserError(
            f"tokenizer {where!r} has no EOS token (eos_token in tokenizer_config.json) and its model's config.json "
            f"names no eos_token_id, but {needs}; set eos_token in tokenizer_config.json or use another tokenizer="
        )
    if tokenizer.pad_token_id is None:
        raise UserError(
            f"tokenizer {where!r} has neither a padding token nor an EOS token to pad batches with; set pad_token "
            "(or eos_token) in its tokenizer_config.json or use another tokenizer="
        )


# ----------------------------------------------------------------------------------------------- tokenizing


def tokenize_classification(
    split: datasets.Dataset, tokenizer, max_length: int, desc: str, token_types: bool
) -> datasets.Dataset:
    """Token ids (and `length`) of each row's text, or of its pair: with the tokenizer's own pair template and
    token type ids where the family has them (`token_types`, BERT: [CLS] A [SEP] B [SEP]), else the two texts
    joined by the EOS token (A EOS B: GPT models have no pair template). A pair too long for `max_length` loses
    tokens from the end of its longer text first (transformers' longest_first)."""
    pairs = "text_pair" in split.column_names
    # a test row's empty text (kept: every test row is predicted) is no token for GPT tokenizers; the model reads
    # the EOS token in its place (or [PAD] for a tokenizer without one), as it does between a pair's texts
    nothing = [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.pad_token_id]

    def encode(batch):
        if not pairs:
            ids = tokenizer(batch["text"], truncation=True, max_length=max_length)["input_ids"]
            ids = [x or nothing for x in ids]
            return {"input_ids": ids, "length": [len(x) for x in ids]}
        if token_types:
            encoded = tokenizer(
                batch["text"], batch["text_pair"], truncation=True, max_length=max_length, return_token_type_ids=True
            )
            ids = encoded["input_ids"]
            return {"input_ids": ids, "token_type_ids": encoded["token_type_ids"], "length": [len(x) for x in ids]}
        firsts, seconds = tokenizer(batch["text"])["input_ids"], tokenizer(batch["text_pair"])["input_ids"]
        ids = [joined_pair(a, b, tokenizer.eos_token_id, max_length) for a, b in zip(firsts, seconds)]
        return {"input_ids": ids, "length": [len(x) for x in ids]}

    keep = [c for c in ("label", "index") if c in split.column_names]
    return split.map(encode, batched=True, remove_columns=[c for c in split.column_names if c not in keep], desc=desc)


def joined_pair(first: list[int], second: list[int], separator: int, max_length: int) -> list[int]:
    """first + [separator] + second, cut to `max_length` by dropping the longer text's last tokens first."""
    first, second = list(first), list(second)
    while len(first) + len(second) + 1 > max_length and (first or second):
        (first if len(first) > len(second) else second).pop()
    return first + [separator] + second


def tokenize_causal_lm(split: datasets.Dataset, tokenizer, block_size: int, desc: str) -> datasets.Dataset:
    """Sentences joined with EOS and cut into full blocks of `block_size` tokens (the remainder is dropped)."""
    ids = tokenizer(column(split, "text"))["input_ids"]
    stream: list[int] = []
    for sentence in tqdm(ids, desc=desc, disable=not _show_progress()):
        stream.extend(sentence)
        stream.append(tokenizer.eos_token_id)
    blocks = [stream[i : i + block_size] for i in range(0, len(stream) - block_size + 1, block_size)]
    if not blocks:
        raise UserError(
            f"causal_lm: the {desc} split has {len(stream)} tokens, fewer than one block of "
            f"max_length={block_size}; lower max_length"
        )
    return datasets.Dataset.from_dict({"input_ids": blocks, "length": [block_size] * len(blocks)})


def _show_progress() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _save_atomically(folder: Path, save) -> None:
    """Write into a temporary sibling and rename, so a crash never leaves a half-written cache."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process finished the same cache first
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class PreparedData:
    # tokenized: input_ids, length[, token_type_ids][, label][, index]; task=sft: target_mask, targets, prompt_length
    splits: datasets.DatasetDict
    tokenizer: PreTrainedTokenizerFast
    source: Source
    cache_path: Path
    task: Task


def prepare(
    *,
    data: DataSection,
    model: ModelSection,
    family: Family,
    model_name: str | None,
    seed: int,
    predict: bool,
) -> PreparedData:
    """Load (or build and cache) the tokenized splits of the run's data (`data` and the task keys of `model`:
    tasks.load_task reads them; `seed` draws a held-out validation split, `predict` needs a test split).
    `model_name`: where the pretrained tokenizer is (resolve.choose_model's name or its local folder; None at
    size=tiny); `family`: the tokenizer a tiny model learns, and whether pairs get the tokenizer's template and
    token type ids (BERT). Safe to call on one rank while others wait."""
    token_types = family.pair_token_types
    cache_dir = Path(data.cache_dir)
    check_writable(cache_dir, "cache_dir")
    raw, task, source = load_raw(data=data, model=model, seed=seed, predict=predict)
    kind = task.kind
    tokenizer = run_tokenizer(
        data=data, model=model, family=family, model_name=model_name, raw=raw, task=task, source=source
    )
    check_inserted_tokens(
        tokenizer, model.tokenizer or model_name, task.head is HeadKind.CAUSAL_LM, task.pair and not token_types
    )
    described = json.dumps([task.to_json(), token_types and task.pair], sort_keys=True)
    spec = hashlib.sha256(described.encode()).hexdigest()[:8]
    tokens = f"tok{tokenizer_identity(tokenizer)}-{model.task}-len{data.max_length}"
    tokens += kind.cache_key(data.train_on)  # what else its tokens depend on (sft: train_on; dpo: the pairs' format)
    path = cache_dir / f"{task.name}-{source.fingerprint}-{spec}-{tokens}"
    if path.is_dir():
        return load_prepared(path, source)
    log.info("tokenizing %s (%s) for %s -> %s", task.name, source.description, task.problem_type, path)
    splits = {}
    for split in raw:
        if kind.reward_model:
            splits[split] = reward.tokenize_reward_pairs(raw[split], tokenizer, data.max_length, split)
        elif kind.prompts:
            splits[split] = prompts.tokenize_prompts(raw[split], tokenizer, data.max_length, split)
        elif kind.pairs:
            splits[split] = preference.tokenize_pairs(raw[split], tokenizer, data.max_length, split)
        elif kind.unpaired:
            splits[split] = kto.tokenize_kto(raw[split], tokenizer, data.max_length, split)
        elif kind.conversations:
            splits[split] = chat.tokenize_sft(
                raw[split], tokenizer, data.max_length, data.train_on, split, data.chat_template
            )
        elif task.head is HeadKind.CAUSAL_LM:
            splits[split] = tokenize_causal_lm(raw[split], tokenizer, data.max_length, split)
        else:
            splits[split] = tokenize_classification(raw[split], tokenizer, data.max_length, split, token_types)
    tokenized = datasets.DatasetDict(splits)

    def save(folder: Path) -> None:
        tokenized.save_to_disk(str(folder))
        tokenizer.save_pretrained(folder / "tokenizer")  # so other ranks and later runs need no Hub
        write_label_file(folder, task)

    _save_atomically(path, save)
    return load_prepared(path, source)


def run_tokenizer(
    *, data: DataSection, model: ModelSection, family: Family, model_name: str | None, raw, task: Task, source: Source
) -> PreTrainedTokenizerFast:
    """The run's tokenizer for `raw` (load_raw's splits): learned from the training rows (a tiny model) or loaded;
    task=sft's chat template set on it and checked (chat.apply_template), so the cached and exported tokenizer
    renders conversations as training did. --check makes the same to render a sample of the rows."""
    learned = model.tokenizer is None and model.size == "tiny"  # a tokenizer learned from the rows
    instruction = task.kind.chat_template(raw["train"])  # sft's conversations, dpo's pairs of messages
    template = (
        chat.template_text(data.chat_template or (chat.TINY_DEFAULT if learned else None)) if instruction else None
    )
    tokenizer = load_tokenizer(
        model.tokenizer,
        model.size,
        model_name,
        TinyTokenizer(
            family.tiny_tokenizer,
            model.tokenizer_vocab_size,
            tuple(chat.template_specials(template)) if template else (),
        ),
        _tokenizer_sentences(raw["train"]),
        source,
        Path(data.cache_dir),
    )
    if instruction:
        name = chat.apply_template(tokenizer, data.chat_template, learned, model.tokenizer or model_name or "tiny")
        log.info("%s", task.kind.template_note(name, data.train_on))
    return tokenizer


def _tokenizer_sentences(train: datasets.Dataset) -> list[str]:
    """What a tiny model's tokenizer learns from: the texts (and pairs), or every message of the conversations."""
    if "messages" in train.column_names:
        return [m["content"] for row in column(train, "messages") for m in json.loads(row)] + list(ROLES)
    if "chosen" in train.column_names or "completion" in train.column_names:  # preference rows: every text or message
        texts = []
        for name in [c for c in ("prompt", "chosen", "rejected", "completion") if c in train.column_names]:
            for cell in map(json.loads, column(train, name)):
                texts += [cell] if isinstance(cell, str) else [m["content"] for m in cell]
        return texts + list(ROLES)
    if "columns" in train.column_names:  # prompts (grpo): every text, or every message's, and the answers' text
        texts = []
        for cell in map(json.loads, column(train, "prompt")):
            texts += [cell] if isinstance(cell, str) else [m["content"] for m in cell]
        for cell in map(json.loads, column(train, "columns")):
            texts += [str(value) for value in cell.values()]
        return texts + list(ROLES)
    return column(train, "text") + (column(train, "text_pair") if "text_pair" in train.column_names else [])


def load_prepared(path: Path, source: Source) -> PreparedData:
    """A cache folder written by `prepare`."""
    return PreparedData(
        datasets.load_from_disk(str(path)), load_hf_tokenizer(path / "tokenizer"), source, path, read_label_file(path)
    )


def column(split: datasets.Dataset, name: str) -> list:
    """A whole column as a Python list: per-row access to a `datasets` Column costs ~10 us, a list ~50 ns."""
    return split[name][:]

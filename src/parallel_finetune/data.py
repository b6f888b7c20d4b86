"""SST-2 from its source to padded batches: read, validate, tokenize, cache, sample, collate.

Sources, in order of preference: a local folder of GLUE TSVs (`data_dir`), the Hugging Face Hub
(`nyu-mll/glue`, config `sst2`), or the small sample shipped in `data/sst2-sample` (loudly announced).
Batches are padded per batch, never to a fixed length: SST-2 sentences average ~10 words.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
import random
import shutil
import stat
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .errors import UserError
from .pretrained import load_hf_tokenizer
from .reporting import check_writable
from .resolve import pretrained_name

log = logging.getLogger(__name__)

HUB_DATASET = ("nyu-mll/glue", "sst2")
SAMPLE_DIR = Path(__file__).resolve().parent / "sample_data"
SPLIT_FILES = {"train": "train.tsv", "validation": "dev.tsv", "test": "test.tsv"}
REQUIRED_COLUMNS = {"train": ("sentence", "label"), "validation": ("sentence", "label"), "test": ("sentence",)}
EOS = "<|endoftext|>"
# Bounds on a data file, far above SST-2 (train.tsv 3.8 MB; longest row 270 characters, longest word 38): a file is
# held in memory whole, and learning a tiny model's tokenizer takes time quadratic in a word's length (one word of
# 100,000 characters costs seconds, of a few megabytes hours).
MAX_DATA_FILE_BYTES = 2**30
MAX_ROW_CHARS = 100_000
MAX_WORD_CHARS = 1_000


@dataclass(frozen=True)
class Source:
    kind: str  # "tsv" | "hub" | "sample"
    description: str  # for logs and summary.json
    fingerprint: str  # changes whenever the rows could change


# ----------------------------------------------------------------------------------------------- reading


def read_glue_tsv(path: Path, split: str) -> dict[str, list]:
    """One GLUE TSV file as columns; every problem is a one-line error naming the file (and line). A UTF-8 byte
    order mark and any line ending (LF, CRLF, CR) are accepted; rows with an empty sentence are dropped and
    counted (a 0-token row has nothing to classify). A file, row or word beyond MAX_DATA_FILE_BYTES,
    MAX_ROW_CHARS or MAX_WORD_CHARS is refused (the file before it is read)."""
    try:
        info = path.stat()
        if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):  # a FIFO or device: the read blocks
            raise UserError(f"{path}: not a regular file (a FIFO, socket or device); give a file of GLUE SST-2 rows")
        if stat.S_ISREG(info.st_mode) and info.st_size > MAX_DATA_FILE_BYTES:
            raise UserError(
                f"{path}: {info.st_size / 2**30:.1f} GiB, more than the {MAX_DATA_FILE_BYTES / 2**30:g} GiB a data "
                "file may have (it is read into memory whole; SST-2's train.tsv is 3.8 MB)"
            )
        raw = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file (a GLUE SST-2 folder holds train.tsv and dev.tsv)") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror})") from None
    lines = raw.removeprefix(codecs.BOM_UTF8).splitlines()
    text_lines = []
    for number, line in enumerate(lines, start=1):
        try:
            text_lines.append(line.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise UserError(
                f"{path}:{number}: not UTF-8 text (byte 0x{line[exc.start]:02x} at column {exc.start + 1})"
            ) from None
        if len(text_lines[-1]) > MAX_ROW_CHARS:
            raise UserError(
                f"{path}:{number}: {len(text_lines[-1]):,} characters, more than the {MAX_ROW_CHARS:,} a row may "
                "have (SST-2's longest has 270)"
            )
    if not text_lines:
        raise UserError(f"{path}: empty file; expected a header line ({chr(9).join(REQUIRED_COLUMNS[split])}) and rows")
    header = text_lines[0].split("\t")
    missing = [c for c in REQUIRED_COLUMNS[split] if c not in header]
    if missing:
        raise UserError(
            f"{path}: header lacks column(s) {', '.join(missing)} "
            f"(found: {', '.join(header) or 'nothing'}; GLUE SST-2 has sentence<TAB>label)"
        )
    columns: dict[str, list] = {"sentence": []}
    sentence_at = header.index("sentence")
    label_at = header.index("label") if "label" in header else None
    if label_at is not None:
        columns["label"] = []
    empty: list[int] = []
    for number, line in enumerate(text_lines[1:], start=2):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != len(header):
            raise UserError(f"{path}:{number}: {len(fields)} tab-separated fields, the header has {len(header)}")
        if label_at is not None:
            label = fields[label_at].strip()
            if label not in ("0", "1"):
                raise UserError(f"{path}:{number}: label {label!r} is not 0 or 1")
        if not fields[sentence_at].strip():
            empty.append(number)
            continue
        longest = max(fields[sentence_at].split(), key=len) if len(fields[sentence_at]) > MAX_WORD_CHARS else ""
        if len(longest) > MAX_WORD_CHARS:
            raise UserError(
                f"{path}:{number}: a word of {len(longest):,} characters ({longest[:20]!r}...), more than the "
                f"{MAX_WORD_CHARS:,} a word may have (learning a tokenizer takes time quadratic in a word's length)"
            )
        columns["sentence"].append(fields[sentence_at].strip())
        if label_at is not None:
            columns["label"].append(int(label))
    if empty:
        log.warning(
            "%s: dropped %d row(s) with an empty sentence (line%s %s)",
            path,
            len(empty),
            "s" if len(empty) > 1 else "",
            ", ".join(map(str, empty[:5])) + (", ..." if len(empty) > 5 else ""),
        )
    if not columns["sentence"]:
        raise UserError(f"{path}: no data rows (the {split} split is empty)")
    return columns


def write_glue_tsv(split_rows: datasets.Dataset, path: Path, split: str) -> None:
    """The inverse of read_glue_tsv (sentence<TAB>label, or index<TAB>sentence for the unlabelled test split)."""
    sentences = column(split_rows, "sentence")
    if split == "test":
        lines = ["index\tsentence", *(f"{i}\t{s}" for i, s in enumerate(sentences))]
    else:
        lines = ["sentence\tlabel", *(f"{s}\t{label}" for s, label in zip(sentences, column(split_rows, "label")))]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def read_glue_dir(data_dir: str | Path) -> datasets.DatasetDict:
    folder = Path(data_dir).expanduser()
    if not folder.is_dir():
        raise UserError(f"data_dir={str(data_dir)!r}: no such folder (expected GLUE SST-2 train.tsv and dev.tsv)")
    splits = {}
    for split, name in SPLIT_FILES.items():
        if split == "test" and not (folder / name).exists():
            continue
        splits[split] = datasets.Dataset.from_dict(read_glue_tsv(folder / name, split))
    return datasets.DatasetDict(splits)


def _file_fingerprint(folder: Path) -> str:
    digest = hashlib.sha256()
    for name in SPLIT_FILES.values():
        if (folder / name).exists():
            digest.update(name.encode())
            with open(folder / name, "rb") as file:
                while chunk := file.read(2**24):
                    digest.update(chunk)
    return digest.hexdigest()[:16]


def tsv_fingerprint(data_dir: str | Path) -> str:
    """A data_dir's fingerprint (its Source's), from its files alone: what a checkpoint records of its data."""
    return "tsv-" + _file_fingerprint(Path(data_dir).expanduser().resolve())


def hub_unreachable() -> str | None:
    """Why the Hub cannot serve SST-2, found with one quick request (the datasets client retries each file five
    times, ~25 s of warnings from each process, before giving up), or None. With HF_HUB_OFFLINE=1 nothing is
    asked: the local Hub cache decides."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return None
    from huggingface_hub import constants

    request = urllib.request.Request(f"{constants.ENDPOINT}/api/datasets/{HUB_DATASET[0]}", method="HEAD")
    try:
        urllib.request.urlopen(request, timeout=float(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT", "10"))).close()
    except urllib.error.HTTPError:
        return None  # it answered: anything else (a rate limit, a gated repo) is for datasets to report
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
    return None


def load_raw(data_dir: str | None) -> tuple[datasets.DatasetDict, Source]:
    """The SST-2 splits (train, validation[, test]) with columns sentence[, label], and where they came from."""
    if data_dir:
        raw = read_glue_dir(data_dir)
        folder = Path(data_dir).expanduser().resolve()
        return raw, Source("tsv", str(folder), tsv_fingerprint(folder))
    problem = hub_unreachable()
    if problem is None:
        try:
            hub = datasets.load_dataset(*HUB_DATASET)
        except Exception as exc:  # offline, blocked, or rate-limited: all leave only the sample
            problem = type(exc).__name__
    if problem is not None:
        log.warning(
            "THE HUGGING FACE HUB IS UNREACHABLE (%s): TRAINING ON THE SMALL SHIPPED SAMPLE %s, NOT ON "
            "SST-2; pass data_dir=PATH (a folder with GLUE's train.tsv and dev.tsv) for the real data set",
            problem,
            SAMPLE_DIR,
        )
        return read_glue_dir(SAMPLE_DIR), Source("sample", str(SAMPLE_DIR), "sample-" + _file_fingerprint(SAMPLE_DIR))
    raw = datasets.DatasetDict({split: hub[split].select_columns(["sentence", "label"]) for split in hub})
    return raw, Source("hub", "/".join(HUB_DATASET), f"hub-{hub['train']._fingerprint}")


# ----------------------------------------------------------------------------------------------- tokenizer


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of everything that decides token ids, for cache keys."""
    state = (
        tokenizer.backend_tokenizer.to_str() if tokenizer.is_fast else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    )
    digest = hashlib.sha256(state.encode())
    digest.update(f"{tokenizer.padding_side}|{tokenizer.pad_token}".encode())
    return digest.hexdigest()[:16]


def train_tokenizer(kind: str, sentences: list[str], vocab_size: int, folder: Path) -> PreTrainedTokenizerFast:
    """A tokenizer learned from the training sentences, so tiny models run without the Hub: byte-level BPE for
    the GPT families, lower-cased WordPiece with [CLS] ... [SEP] for BERT."""
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
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
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
    return tokenizer


def load_tokenizer(
    name: str | None,
    size: str,
    model_name: str,
    tiny_kind: str,
    vocab_size: int,
    train_sentences: list[str],
    source: Source,
    cache_dir: Path,
) -> PreTrainedTokenizerFast:
    if name is None and size == "tiny":
        folder = cache_dir / "tokenizers" / f"{tiny_kind}{vocab_size}-{source.fingerprint}"
        if folder.is_dir():
            return load_hf_tokenizer(folder)
        log.info(
            "training a %s tokenizer (vocab %d) on %d sentences -> %s",
            tiny_kind,
            vocab_size,
            len(train_sentences),
            folder,
        )
        return train_tokenizer(tiny_kind, train_sentences, vocab_size, folder)
    from .families.base import resolve_model_path

    where = name or model_name
    try:
        tokenizer = load_hf_tokenizer(resolve_model_path(where))
    except UserError:
        raise
    except Exception as exc:
        raise UserError(
            f"tokenizer {where!r}: cannot be loaded ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        ) from None
    if tokenizer.pad_token is None:
        # GPT tokenizers have no pad token; padding positions are masked out, so any id works, EOS is customary.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ----------------------------------------------------------------------------------------------- tokenizing


def tokenize_classification(split: datasets.Dataset, tokenizer, max_length: int, desc: str) -> datasets.Dataset:
    def encode(batch):
        ids = tokenizer(batch["sentence"], truncation=True, max_length=max_length)["input_ids"]
        return {"input_ids": ids, "length": [len(x) for x in ids]}

    keep = ["label"] if "label" in split.column_names else []
    return split.map(encode, batched=True, remove_columns=[c for c in split.column_names if c not in keep], desc=desc)


def tokenize_causal_lm(split: datasets.Dataset, tokenizer, block_size: int, desc: str) -> datasets.Dataset:
    """Sentences joined with EOS and cut into full blocks of `block_size` tokens (the remainder is dropped)."""
    ids = tokenizer(column(split, "sentence"))["input_ids"]
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
    splits: datasets.DatasetDict  # tokenized: input_ids, length[, label]
    tokenizer: PreTrainedTokenizerFast
    source: Source
    cache_path: Path


def prepare(
    task: str,
    data_dir: str | None,
    cache_dir: str | Path,
    max_length: int,
    tokenizer_name: str | None,
    size: str,
    model_name: str,
    tokenizer_vocab_size: int,
    tiny_tokenizer: str = "bpe",
) -> PreparedData:
    """Load (or build and cache) the tokenized splits. Safe to call on one rank while others wait."""
    cache_dir = Path(cache_dir)
    check_writable(cache_dir, "cache_dir")
    raw, source = load_raw(data_dir)
    tokenizer = load_tokenizer(
        tokenizer_name,
        size,
        model_name,
        tiny_tokenizer,
        tokenizer_vocab_size,
        column(raw["train"], "sentence"),
        source,
        cache_dir,
    )
    key = f"sst2-{source.fingerprint}-tok{tokenizer_identity(tokenizer)}-{task}-len{max_length}"
    path = cache_dir / key
    if path.is_dir():
        return load_prepared(path, source)
    log.info("tokenizing SST-2 (%s) for %s -> %s", source.description, task, path)
    tokenize = tokenize_classification if task == "classification" else tokenize_causal_lm
    splits = {}
    for split in raw:
        if task == "causal_lm" and split == "test":
            continue  # GLUE test has no labels and a language model needs none, but nothing evaluates it
        splits[split] = tokenize(raw[split], tokenizer, max_length, split)
    tokenized = datasets.DatasetDict(splits)

    def save(folder: Path) -> None:
        tokenized.save_to_disk(str(folder))
        tokenizer.save_pretrained(folder / "tokenizer")  # so other ranks and later runs need no Hub

    _save_atomically(path, save)
    return load_prepared(path, source)


def prepare_for_config(config, model_path: str | None = None) -> PreparedData:
    """`prepare` with a run's Config (the trainer and scripts/prepare_data.py share it); `model_path`: the
    pretrained model's local folder when the caller fetched it already."""
    from .families import get_family

    family = get_family(config.family)
    return prepare(
        config.task,
        config.data_dir,
        config.cache_dir,
        config.max_length,
        config.tokenizer,
        config.size,
        model_path or pretrained_name(config),
        config.tokenizer_vocab_size,
        family.tiny_tokenizer,
    )


def load_prepared(path: Path, source: Source) -> PreparedData:
    """A cache folder written by `prepare`."""
    return PreparedData(datasets.load_from_disk(str(path)), load_hf_tokenizer(path / "tokenizer"), source, path)


# ----------------------------------------------------------------------------------------------- batching


def column(split: datasets.Dataset, name: str) -> list:
    """A whole column as a Python list: per-row access to a `datasets` Column costs ~10 us, a list ~50 ns."""
    return split[name][:]


class GlobalBatches:
    """The index lists of an epoch's global batches, identical on every rank (same seed, same epoch).

    Every rank draws the same global batches and takes its own slice, so the optimizer sees the same samples
    whatever the data-parallel degree or accumulation. With `group_by_length`, each global batch holds samples
    of similar length (sorted inside shuffled mega-batches), which removes most padding.
    """

    MEGA_BATCH = 50  # global batches per sorting window, as in transformers' LengthGroupedSampler

    def __init__(self, lengths: list[int], batch_size: int, seed: int, group_by_length: bool):
        if len(lengths) < batch_size:
            raise UserError(f"batch_size={batch_size} is larger than the training split ({len(lengths)} rows)")
        self.lengths = lengths
        self.batch_size = batch_size
        self.seed = seed
        self.group_by_length = group_by_length

    def __len__(self) -> int:
        return len(self.lengths) // self.batch_size

    def epoch(self, epoch: int) -> list[list[int]]:
        order = list(range(len(self.lengths)))
        rng = random.Random(self.seed * 1_000_003 + epoch)
        rng.shuffle(order)
        usable = len(self) * self.batch_size
        if self.group_by_length:
            window = self.batch_size * self.MEGA_BATCH
            order = [
                i
                for start in range(0, len(order), window)
                for i in sorted(order[start : start + window], key=lambda i: -self.lengths[i])
            ]
            batches = [
                order[i : i + self.batch_size] for i in range(0, len(order) - self.batch_size + 1, self.batch_size)
            ]
            rng.shuffle(batches)
            return batches[: len(self)]
        return [order[i : i + self.batch_size] for i in range(0, usable, self.batch_size)]


def accumulation_slices(global_batch: list[int], dp_rank: int, dp_size: int, accumulation: int) -> list[list[int]]:
    """This rank's share of a global batch, cut into `accumulation` slices (gradient accumulation: one forward
    and backward each; a pipeline cuts a slice again into its `microbatches`)."""
    per_slice = len(global_batch) // (dp_size * accumulation)
    return [
        global_batch[(step * dp_size + dp_rank) * per_slice : (step * dp_size + dp_rank + 1) * per_slice]
        for step in range(accumulation)
    ]


def token_slots(global_batch: list[int], lengths: list[int], dp: int, accumulation: int, multiple: int = 1) -> int:
    """Token positions a global batch occupies once each replica's accumulation slices are padded to their longest
    row (rounded up to `multiple`): real tokens / this = the useful share of the compute."""
    slots = 0
    for replica in range(dp):
        for indices in accumulation_slices(global_batch, replica, dp, accumulation):
            if indices:
                slots += len(indices) * -(-max(lengths[i] for i in indices) // multiple) * multiple
    return slots


def collate(
    input_ids: list[list[int]],
    pad_id: int,
    padding_side: str,
    labels: list[int] | None = None,
    pad_to_multiple_of: int = 1,
) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence of this batch (rounded up to a multiple, e.g. 8 for tensor cores)."""
    longest = max(len(ids) for ids in input_ids)
    longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    ids = torch.full((len(input_ids), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(input_ids), longest), dtype=torch.long)
    for row, seq in enumerate(input_ids):
        span = slice(0, len(seq)) if padding_side == "right" else slice(longest - len(seq), longest)
        ids[row, span] = torch.tensor(seq, dtype=torch.long)
        mask[row, span] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if labels is not None:
        batch["labels"] = torch.tensor(labels, dtype=torch.long)
    return batch


def device_batch(
    indices: list[int], ids: list, labels: list | None, tokenizer, pad_multiple: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Rows `indices` of `ids` (and `labels`) padded into tensors on `device`: a training slice or a dev chunk."""
    batch = collate(
        [ids[i] for i in indices],
        tokenizer.pad_token_id,
        tokenizer.padding_side,
        [labels[i] for i in indices] if labels is not None else None,
        pad_to_multiple_of=pad_multiple,
    )
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

"""The nine GLUE tasks as GLUE ships them: each task's files, columns, labels and official metric.

A GLUE folder (`data_dir`) holds a task's files as the GLUE download unpacks them: tab-separated, no quoting (GLUE's
texts hold stray quote characters), a header line except CoLA's train and dev files. Label names and their order
are those of the Hugging Face `nyu-mll/glue` data set, so a model trained from the files or from the Hub gets the
same label ids; `values` are the labels as the files write them (what GLUE's submission format wants back).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GlueTask:
    name: str
    text: str  # the column holding the (first) text, by the file's header name (CoLA: by position)
    text_pair: str | None
    label: str  # the label column (STS-B: its float score)
    names: tuple[str, ...]  # label id -> name (empty: regression)
    values: tuple[str, ...]  # label id -> the value the files write
    validation_files: tuple[str, ...] = ("dev.tsv",)
    test_files: tuple[str, ...] = ("test.tsv",)
    headerless: tuple[str, ...] = ()  # CoLA's train/dev: source, label, original label, sentence
    hub_text: str = "sentence"  # the Hub data set's column names
    hub_text_pair: str | None = None
    # STS-B: some lines carry more tab-separated fields than the header; the texts are the header's columns and the
    # score is the line's last field (as transformers' StsbProcessor reads it); a test line's extra fields are dropped
    score_last: bool = False

    @property
    def regression(self) -> bool:
        return not self.names

    def split_files(self) -> dict[str, str]:
        """Split name -> file name; MNLI's second dev and test files become validation_mismatched and
        test_mismatched."""
        files = {"train": "train.tsv"}
        for kind, names in (("validation", self.validation_files), ("test", self.test_files)):
            for number, name in enumerate(names):
                files[kind if number == 0 else f"{kind}_mismatched"] = name
        return files


TASKS = {
    task.name: task
    for task in (
        GlueTask(
            "cola",
            "sentence",
            None,
            "label",
            ("unacceptable", "acceptable"),
            ("0", "1"),
            headerless=("source", "label", "original_label", "sentence"),
        ),
        GlueTask("sst2", "sentence", None, "label", ("negative", "positive"), ("0", "1")),
        GlueTask(
            "mrpc",
            "#1 String",
            "#2 String",
            "Quality",
            ("not_equivalent", "equivalent"),
            ("0", "1"),
            hub_text="sentence1",
            hub_text_pair="sentence2",
        ),
        GlueTask(
            "qqp",
            "question1",
            "question2",
            "is_duplicate",
            ("not_duplicate", "duplicate"),
            ("0", "1"),
            hub_text="question1",
            hub_text_pair="question2",
        ),
        GlueTask(
            "stsb",
            "sentence1",
            "sentence2",
            "score",
            (),
            (),
            hub_text="sentence1",
            hub_text_pair="sentence2",
            score_last=True,
        ),
        GlueTask(
            "mnli",
            "sentence1",
            "sentence2",
            "gold_label",
            ("entailment", "neutral", "contradiction"),
            ("entailment", "neutral", "contradiction"),
            validation_files=("dev_matched.tsv", "dev_mismatched.tsv"),
            test_files=("test_matched.tsv", "test_mismatched.tsv"),
            hub_text="premise",
            hub_text_pair="hypothesis",
        ),
        GlueTask(
            "qnli",
            "question",
            "sentence",
            "label",
            ("entailment", "not_entailment"),
            ("entailment", "not_entailment"),
            hub_text="question",
            hub_text_pair="sentence",
        ),
        GlueTask(
            "rte",
            "sentence1",
            "sentence2",
            "label",
            ("entailment", "not_entailment"),
            ("entailment", "not_entailment"),
            hub_text="sentence1",
            hub_text_pair="sentence2",
        ),
        GlueTask(
            "wnli",
            "sentence1",
            "sentence2",
            "label",
            ("not_entailment", "entailment"),
            ("0", "1"),
            hub_text="sentence1",
            hub_text_pair="sentence2",
        ),
    )
}
GLUE_TASK_NAMES = tuple(TASKS)

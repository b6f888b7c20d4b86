"""The walkthrough notebooks as committed: no outputs, and a parameters cell papermill reads completely.

(`make notebooks` executes them top to bottom; test_sagemaker runs one with LAUNCH="sagemaker".)"""

from __future__ import annotations

import json
import re

import papermill
import pytest
from conftest import FAMILIES, REPO

REQUIRED = {"LAUNCH", "SIZE", "DATA", "MAX_STEPS", "NPROC", "RECIPE", "ARGS", "INSTANCE_TYPE", "INSTANCE_COUNT"}


# Every family's walkthrough (a notebook is optional for a family registered from a file), instruction tuning's and
# preference tuning's.
NOTEBOOKS = [name for name in (*FAMILIES, "sft", "dpo") if (REPO / "notebooks" / f"{name}.ipynb").is_file()]


@pytest.mark.parametrize("family", NOTEBOOKS)
def test_notebook_is_committed_clean_with_a_complete_parameters_cell(family):
    path = REPO / "notebooks" / f"{family}.ipynb"
    cells = json.loads(path.read_text())["cells"]
    code = [cell for cell in cells if cell["cell_type"] == "code"]
    assert all(not cell.get("outputs") and cell.get("execution_count") is None for cell in code), "outputs committed"
    (parameters,) = [cell for cell in code if "parameters" in cell["metadata"].get("tags", [])]
    assigned = set(re.findall(r"^([A-Z_]+) *=", "".join(parameters["source"]), flags=re.M))
    assert REQUIRED <= assigned
    # papermill skips (with a warning) any line it cannot parse, e.g. one with a second "=" in its comment.
    assert set(papermill.inspect_notebook(str(path))) == assigned


def test_data_is_read_as_make_reads_it(tmp_path):
    """DATA: a file of rows -> train_file, a save_to_disk folder -> dataset, a GLUE folder -> data_dir (absolute)."""
    from parallel_finetune.tools.notebook import data_overrides

    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_dict.json").write_text("{}")
    (tmp_path / "rows.tsv").write_text("text\tlabel\n")
    assert data_overrides("") == []
    assert data_overrides(tmp_path / "rows.tsv") == [f"train_file={tmp_path / 'rows.tsv'}"]
    assert data_overrides(tmp_path / "later.parquet") == [f"train_file={tmp_path / 'later.parquet'}"]
    assert data_overrides(tmp_path / "saved") == [f"dataset={tmp_path / 'saved'}"]
    assert data_overrides(tmp_path) == [f"data_dir={tmp_path}"]

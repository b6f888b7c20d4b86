"""The outputs floor: what a run writes and reads back.

runfolder.py, run_files.py   the run folder: chosen, claimed, locked, recorded; its file names
checkpoint.py, integrity.py  checkpoints: written, verified, resumed, compared
export.py, convert.py        a run's export (hf/, adapter/), a checkpoint converted (scripts/export_hf.py)
reporting.py, loggers.py     the progress bar, metrics files, TensorBoard, MLflow, W&B
summary.py                   summary.json
"""

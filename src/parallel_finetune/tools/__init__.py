"""Tools around runs, not in them.

    planner.py     memory and time estimates per layout (scripts/plan.py, recipes' headers, --check's fit)
    inference.py   predictions from an exported model or adapter (scripts/predict.py)
    notebook.py    the walkthrough notebooks' helpers

The entry modules stay at the package's top: train (--check runs preflight), launch, selftest, sagemaker_job.
"""

"""The loop floor: a run assembled, trained, evaluated.

builder.py       RunBuilder: a run assembled in stages (layout, resolve, folders; then the three below)
data_stage.py    the data stage: prepared splits, the training split, its sampler (DataStage)
model_stage.py   the model stage: model, updates, objective, runner, lr schedule (BuiltModel)
assembly.py      the loop's assembly: reference pass, checkpoints, batcher, evaluator, generator, reporter, Trainer
objectives.py    the objective registry: a task kind's `objective` name -> its loss
trainer.py       the Trainer: a dataclass of built components, no Config; `due(step)` for each
run.py           a whole run: build -> fit -> evaluate -> predictions -> export -> summary.json
runner.py        WholeModel, a Runner (forward and backward of a Batch); the Pipeline is parallel/'s
updates.py       TorchUpdates, the Updates (gradients -> an update)
loss.py          one loss per head, summed over a Batch's labels
evaluation.py    the Evaluator: metrics of a split over every data-parallel rank; predictions
generation.py    the Generator: greedy answers to held-out prompts (generate_every)
checkpointer.py  the CheckpointManager: resume, cadence, retention
divergence.py    the NonFiniteGuard: skip, then stop, on NaN/inf steps
"""

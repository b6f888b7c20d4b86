"""Online reinforcement learning (GRPO, issue 56): run pieces, in the layer of loop's run pieces (docs/architecture.md
layer 7): they may import the layers beneath (data, tasks, model, parallel, families, loop's lower modules), and the
assembly (layer 8) imports them.

rollout.py   sampling: num_generations completions per prompt, batched with a KV cache, counter-based
             randomness (the same completions under every layout and after a resume)
rewards.py   reward functions (built-ins accuracy, format, length; a user's path/to/file.py:function; a reward
             model model:path/to/folder), their weighted sum and TRL's group-relative advantages
reward_model.py  a one-output sequence classifier as a reward function, as TRL scores one; replicated on every
             rank, its forwards split over the ranks and the scores all-gathered
steps.py     the step source: rollout, scoring, the step's RolloutSplit
"""

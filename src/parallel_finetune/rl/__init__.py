"""Online reinforcement learning (GRPO, issue 56), a floor above loop/: it may import loop, data, tasks, model,
parallel, families and errors; nothing beneath imports it.

rollout.py   sampling: num_generations completions per prompt, batched with a KV cache, counter-based
             randomness (the same completions under every layout and after a resume)
rewards.py   reward functions (built-ins accuracy, format, length; a user's path/to/file.py:function), their
             weighted sum and TRL's group-relative advantages
"""

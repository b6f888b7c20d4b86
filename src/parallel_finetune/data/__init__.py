"""The data floor: rows -> tokens -> batches.

    prepare.py    a run's splits tokenized and cached (tokenizers: a pretrained one, or one learned for a tiny
                  model), PreparedData
    chat.py       chat templates, the rendering of conversations and which tokens are trained (task=sft)
    sampling.py   the global batches of an epoch and each rank's accumulation slices
    batch.py      the data contract: TokenizedSplit, Batch (labels shifted and masked, its kind), the padded and
                  packed batchers
    packing.py    first-fit-decreasing bins of rows for packed batches
    batchers.py   the batcher registry: a task kind's `batcher` name -> its batcher (rows, pairs, reward_pairs)

What a run learns (the Task, its sources and columns) is tasks/, one floor below.
"""

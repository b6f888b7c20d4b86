"""The model floor: what is trained, built and loaded on each rank.

    hub.py, pretrained.py   where a pretrained model's files come from; reading its config and tokenizer
    weights.py              the weights' source, the unsplit model's plan, this rank's shards allocated and read
    load.py                 load_model: the one load path (build on meta -> plan -> parallelize -> load)
    lora.py, quantize.py    LoRA adapters (peft's format), QLoRA's NF4 base
    precision.py            precision names, dtypes, autocast and the fp16 loss scaler
    throughput.py           FLOPs per token, the device's peak, MFU
    synthetic.py            tiny checkpoints written from a config (tests, benchmarks, notebooks)

A model family (families/) says what its modules are; parallel/ places them.
"""

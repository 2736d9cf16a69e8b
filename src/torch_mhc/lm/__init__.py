"""The reference language model behind `mhc train` and `mhc compare`: model, config, data,
train/ (the trainer and its checkpoints), parallel/ (DDP, FSDP2, pipelines, DCP checkpoints).

Imports the library (connections, ops, runtime); the library never imports this package.
"""

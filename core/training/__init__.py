"""Training: turning a task and its data into trained parameters in a run's workdir.

`steps` builds the model and the jitted train and eval steps and runs `fit`; `hooks` are what
`fit` calls between steps (logging, progress, the best checkpoint, saving, preemption);
`optim` the optimizers; `losses` the losses (the fused output-layer cross-entropy, CTC);
`data` batching and prefetching; `sharding` the device mesh and data parallelism;
`checkpoints` a run's orbax checkpoints and JSON files on disk; `transfer` initialising from
another run and linear probes; `memory` the memory estimate; `host` the allocator settings.

Imports: `core.errors`, `core.config`, `core.model`, the contract, `core.checkpoints`.
"""

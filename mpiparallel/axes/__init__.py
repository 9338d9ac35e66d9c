"""Every parallel axis, one module each, applied to the serial model by `mpiparallel.train.parallelize`:

    module                     axis                  enters the model as                 communication
    pipeline_parallel          pp                    `PipelineStages`: the units held    activations stage to stage
    tensor_parallel            tp + sp (Megatron)    `TensorParallel`: shards, parallel  all-reduce (TP) or all-gather
                                                     linears, vocab-parallel head        + reduce-scatter (SP)
    context_parallel/          cp (ring, all-gather  `ContextParallel`: the attention,   K/V around a ring, gathered,
                               and Ulysses; MLA's)   zigzag positions                    or all-to-all by heads
    expert_parallel            ep                    `ExpertParallel`: experts held,     all-to-allv dispatch and
                                                     tokens routed to their ranks        combine, or two hops
    data_parallel              dp, ZeRO-1/2/3,       no layer changes: engines own the   gradient all-reduce or
                               hybrid sharding       parameters, hooks around each unit  reduce-scatter, all-gather

The first four answer the questions the model asks while it builds (`models.axis`); data parallelism runs the
same model on every replica. Each module's docstring states its communication pattern and cost per step.
"""

"""Chapter 11 — tensor parallelism: one forward pass split across ranks (processes, devices).

    parallel_state.py   one rank's view of the group: rank, size, all_reduce, gather, the step broadcast
    linear.py           ColumnParallelLinear (slices of the output features), RowParallelLinear (+ all_reduce)
    vocab.py            VocabParallelEmbedding, ParallelLMHead (slices of the vocabulary, logits gathered)
    shard.py            which heads a rank holds; a Llama whose layers are those shards; loading a rank's slice
    multiproc.py        the N − 1 worker processes: start, ready or a clear error, the step loop, shutdown, faults
    cost_model.py       what TP costs and saves on real GPUs (compute, weight bytes, all-reduce bytes)
"""

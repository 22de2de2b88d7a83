"""Partitioned execution over torch.distributed: one engine on several ranks (started by
torchrun, so the same code spans machines). Rank 0 schedules, samples and talks to users; it
sends each step's inputs to every rank, and all ranks run the model in lock step on their
shard of weights and KV.

  state.py            the process group, this rank's place in it, and the shared-memory
                      all-reduce group of ranks on one host
  tensor_parallel.py  Megatron 1D weight-stationary sharding of a loaded model (weight slicing
                      plus all-reduce hooks; vocab-parallel embedding and LM head)
  helix.py            Helix KV parallelism: each sequence's KV split by blocks over KVP ranks,
                      partial attention, one all-to-all and the exact log-sum-exp merge
  batch_attention.py  attention sharded by batch: each rank keeps its own sequences' KV (every
                      head); all-to-alls between head and batch sharding
  ffn_2d.py           PaLM's 2D weight-stationary FFN over an X x YZ grid of ranks
  comm.py             the collectives those call (shared memory on one host, else the process group)
  step.py             broadcasting a step's inputs from rank 0; the other ranks' step loop
"""

"""Tensor parallelism on torch.distributed: the ranks' groups and collectives (group.py),
where they meet (rendezvous.py), and the Megatron-style layer shards (layers.py)."""

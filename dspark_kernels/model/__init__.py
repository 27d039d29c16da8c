"""The model layer both backends share: what a batch and a model are, and how a forward runs them.

``plan`` (:class:`~dspark_kernels.model.plan.BatchPlan`: every fact derived from a batch, once per batch and
rank), ``attention_weights`` / ``weights`` and ``caches`` (attention layer and whole model; ``block_weights``
holds the hyper-connection, MoE and head weight classes, ``weight_specs`` the model's checkpoint names),
``checkpoint_format``, ``shard_index`` and ``synthetic`` (shipped checkpoint formats, the lazy shard reader,
checkpoints written in those formats for tests), ``experts`` (routed-expert grouping and int8 experts),
``prepared`` (the weights each precision computes with, and the caller-owned cache of them), ``numerics``,
``deepseek_numerics`` (the official inference's fake quantisers), ``rope`` and
``geometry`` (numeric building blocks, RoPE tables, compression geometry), ``checks`` (input checks before any
cache is touched), ``backends`` (the :class:`~dspark_kernels.model.backends.Backend` protocol, the
one attention orchestrator and the registry of backends by name),
``layer``, ``forward`` and ``tp`` (one layer, the forward, the TP group).

The package imports none of its modules: import the one you need.
"""

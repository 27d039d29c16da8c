"""Vectorized numpy reference backend of every DSpark prefill attention stage (the definition other
backends are checked against). One module per stage, mirrored name for name by :mod:`dspark_kernels.pypto`:
``lowering``, ``projections``, ``paged``, ``window``, ``compressor``, ``indexer``, ``entry_rows``,
``sparse_attention``, ``o_proj`` and ``attention`` (the layer: :func:`~dspark_kernels.reference.attention.attention`,
and the backend a forward calls, :func:`~dspark_kernels.reference.attention.attend`). ``hyper_connections``,
``moe`` and ``head`` are the rest of a layer (the model's, reference only). See ``docs/kernels.md``.

The package imports none of its modules (the model layer they build on imports ``head``, ``hyper_connections``
and ``moe``): import the one you need.
"""

"""Conformance: the vectors of spec/v1 and the runner that checks a validator against them.

:mod:`~dspark_abi.conformance.vectors` generates the valid and invalid vectors
(``python -m dspark_abi.conformance.vectors spec/v1/vectors [--check]``), :mod:`~dspark_abi.conformance.hostile`
the unreadable files, :mod:`~dspark_abi.conformance.runner` checks this library or another program against
``index.json``. Built on the core and :mod:`dspark_abi.io`.
"""

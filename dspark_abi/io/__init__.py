"""Files of the ABI: fixture files (:mod:`~dspark_abi.io.fixtures`), their JSON manifest
(:mod:`~dspark_abi.io.manifest`) and its JSON Schema (:mod:`~dspark_abi.io.schema`,
``python -m dspark_abi.io.schema [--check]``). Built on the core; the core never imports it."""

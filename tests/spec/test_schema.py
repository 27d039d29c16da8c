"""The committed JSON Schema is generated from the pydantic models and has not drifted."""

import json

from dspark_abi import ABI_VERSION, CODES, ModelConfig
from dspark_abi.io import schema as schema_mod
from dspark_abi.io.manifest import FORMAT_VERSION, SUPPORTED_VERSIONS

from .conftest import SPEC

SCHEMA = SPEC / "abi.schema.json"


def test_committed_schema_is_up_to_date():
    assert SCHEMA.read_text() == schema_mod.render(), "regenerate with: python -m dspark_abi.io.schema"
    assert schema_mod.main([str(SCHEMA), "--check"]) == 0


def test_check_fails_on_drift(tmp_path, capsys):
    stale = tmp_path / "abi.schema.json"
    stale.write_text(schema_mod.render().replace('"title": "FixtureManifest"', '"title": "Old"'))
    assert schema_mod.main([str(stale), "--check"]) == 1
    assert "out of date" in capsys.readouterr().out
    assert schema_mod.main([str(tmp_path / "missing.json"), "--check"]) == 1
    assert schema_mod.main([str(stale)]) == 0  # regenerating repairs it
    assert schema_mod.main([str(stale), "--check"]) == 0


def test_schema_covers_manifest_and_configuration():
    doc = json.loads(SCHEMA.read_text())
    assert doc["$schema"].endswith("2020-12/schema")
    assert {"ModelConfig", "PaddingPolicy", "PoolBlockCounts", "TensorInfo", "Expectation"} <= set(doc["$defs"])
    config = doc["$defs"]["ModelConfig"]
    assert set(config["properties"]) == set(ModelConfig.model_fields)
    assert config["additionalProperties"] is False
    assert set(doc["required"]) >= {"format", "format_version", "config", "policy", "pool_blocks", "tensors"}
    assert doc["properties"]["format_version"]["enum"] == list(SUPPORTED_VERSIONS)  # 1.1 reads 1.0 manifests too


def test_schema_enumerates_exactly_the_stable_codes():
    doc = json.loads(SCHEMA.read_text())
    items = doc["$defs"]["Expectation"]["properties"]["codes"]["items"]
    assert items["enum"] == list(CODES)


def test_one_version_number():
    assert ABI_VERSION == FORMAT_VERSION == json.loads(SCHEMA.read_text())["x-dspark-format-version"] == "1.4"
    assert SUPPORTED_VERSIONS == ("1.0", "1.1", "1.2", "1.3", "1.4")  # every minor of major 1 up to the one written

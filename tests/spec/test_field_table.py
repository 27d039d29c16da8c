"""The field table of spec section 4.1 is generated from dspark_abi.fields and has not drifted."""

import pytest

from dspark_abi.fields import FIELDS, TABLE_BEGIN, TABLE_END, field_table, with_field_table
from dspark_abi.io import spec_table

from .conftest import SPEC

ABI_MD = SPEC / "abi.md"


def test_committed_table_is_up_to_date():
    text = ABI_MD.read_text()
    assert with_field_table(text) == text, "regenerate with: python -m dspark_abi.io.spec_table"
    assert spec_table.main([str(ABI_MD), "--check"]) == 0
    section = text.split("### 4.1 ", 1)[1].split("### 4.2 ", 1)[0]
    assert TABLE_BEGIN in section and TABLE_END in section


def test_one_row_per_declared_field():
    rows = [line for line in field_table().splitlines()[2:]]
    assert len(rows) == len(FIELDS)
    for row, f in zip(rows, FIELDS, strict=True):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[0].startswith(f"`{f.name}`") and ("(optional" in cells[0]) == (not f.required)
        assert cells[1:5] == [f.shape_text(), f.dtype, f.scope.replace("_", "-"), f.since]


def test_check_fails_on_drift_and_regenerating_repairs_it(tmp_path, capsys):
    stale = tmp_path / "abi.md"
    stale.write_text(ABI_MD.read_text().replace("| `positions` | [P] | int32 |", "| `positions` | [P] | int64 |"))
    assert spec_table.main([str(stale), "--check"]) == 1
    assert "out of date" in capsys.readouterr().out
    assert spec_table.main([str(stale)]) == 0
    assert stale.read_text() == ABI_MD.read_text()
    assert spec_table.main([str(stale), "--check"]) == 0


def test_a_spec_without_the_markers_is_an_error(tmp_path, capsys):
    bare = tmp_path / "abi.md"
    bare.write_text("# no table here\n")
    with pytest.raises(ValueError, match="markers"):
        with_field_table(bare.read_text())
    assert spec_table.main([str(bare), "--check"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert spec_table.main([str(tmp_path / "missing.md")]) == 2

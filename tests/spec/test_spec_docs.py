"""spec/v1/abi.md, docs/errors.md and spec/README.md name exactly the stable codes of dspark_abi.errors.CODES."""

import ast
import re
from collections import Counter

from dspark_abi import CODES

from .conftest import REPO, SPEC, index_entries

RULE = re.compile(r"^- \*\*R(\d+)\*\* \(`([^`]+)`\): (.+)$")


def _rules() -> list[tuple[int, str, str]]:
    lines = (SPEC / "abi.md").read_text().splitlines()
    rules = [(int(m.group(1)), m.group(2), m.group(3)) for m in map(RULE.match, lines) if m]
    # a line that looks like a rule but does not parse must not be silently ignored
    loose = [ln for ln in lines if ln.startswith("- **R") and not RULE.match(ln)]
    assert not loose, loose
    return rules


def test_every_rule_is_a_numbered_must_with_one_registered_code():
    rules = _rules()
    assert [n for n, _, _ in rules] == list(range(1, len(rules) + 1))
    for n, code, text in rules:
        assert code in CODES, f"R{n} names unregistered code {code!r}"
        assert "MUST" in text, f"R{n} is not a MUST statement"


def test_spec_rules_name_exactly_the_registered_codes():
    assert {code for _, code, _ in _rules()} == set(CODES)


def test_spec_code_index_lists_every_code_once():
    text = (SPEC / "abi.md").read_text().split("## 13. Code index", 1)[1]
    cells = re.findall(r"\| `([a-z_]+\.[a-z_]+)` \| (R[\d, R]+) ", text)
    assert Counter(code for code, _ in cells) == Counter(set(CODES))
    by_rule = {}
    for n, code, _ in _rules():
        by_rule.setdefault(code, []).append(f"R{n}")
    for code, refs in cells:
        assert refs.split(", ") == by_rule[code], code


def _error_sections() -> dict[str, str]:
    text = (REPO / "docs" / "errors.md").read_text()
    parts = re.split(r"^## `([^`]+)`$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_errors_doc_lists_exactly_the_registered_codes():
    sections = _error_sections()
    assert list(sections) == list(CODES)


def test_errors_doc_agrees_with_the_registry():
    for code, body in _error_sections().items():
        meaning, hint = CODES[code]
        assert f"**Meaning:** {meaning}." in body, code
        assert f"**Fix:** {hint}." in body, code
        example = body.split("```text\n", 1)[1].split("\n```", 1)[0]
        assert example.startswith(f"{code}: ") and "Fix: " in example, code
        # the generic hint, unless the library's message carries the issue's own exact fix, which the section
        # then says (e.g. the ring size a request needs instead of "give the request a bigger ring")
        assert example.endswith(f"Fix: {hint}") or "its own fix" in body, code
        assert "**When it fires** (R" in body, code


def _test_functions(path) -> set[str]:
    tree = ast.parse((REPO / path).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_coverage_claims_are_true():
    expected_by_vector = {e["file"].removesuffix(".safetensors"): set(e["expected"]["codes"]) for e in index_entries()}
    for doc in (REPO / "docs" / "errors.md", REPO / "spec" / "README.md"):
        text = doc.read_text()
        for code in CODES:
            if doc.name == "errors.md":
                claims = _error_sections()[code].split("**Exercised by:**", 1)[1].split("\n\n", 1)[0]
            else:
                claims = re.search(rf"^\| `{re.escape(code)}` \|(.*)$", text, flags=re.M).group(1)
            names = re.findall(r"`((?:valid|invalid|hostile)/\w+)`", claims)
            tests = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", claims)
            assert names or tests, (doc.name, code)
            for name in names:
                assert code in expected_by_vector[name], (doc.name, code, name)
            for path, func in tests:
                assert func in _test_functions(path), (doc.name, code, path, func)


def test_vectors_named_in_the_docs_exist():
    names = {e["file"].removesuffix(".safetensors") for e in index_entries()}
    for doc in (SPEC / "abi.md", REPO / "spec" / "README.md", REPO / "docs" / "fixtures.md"):
        mentioned = set(re.findall(r"`((?:valid|invalid|hostile)/\w+)(?:\.safetensors)?`", doc.read_text()))
        assert mentioned <= names, (doc.name, mentioned - names)

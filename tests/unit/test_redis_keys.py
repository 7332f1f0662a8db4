"""Redis Cluster hash tags as the cluster spec reads them (the ledger's key prefix)."""

from __future__ import annotations

import pytest

from brownout._redis_keys import hash_tag, tagged


@pytest.mark.parametrize(
    ("name", "tag"),
    [
        ("{user1000}.following", "user1000"),
        ("foo{}{bar}", None),  # the first "{" closes empty: the whole name is hashed
        ("foo{{bar}}zap", "{bar"),
        ("foo{bar}{zap}", "bar"),
        ("plain", None),
        ("open{only", None),
        ("}{x}", "x"),
    ],
)
def test_hash_tag_follows_the_cluster_spec(name: str, tag: str | None) -> None:
    assert hash_tag(name) == tag


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("brownout", "{brownout}"),
        ("app:{ledger}", "app:{ledger}"),
        ("a{}b", "{a{}b}"),  # "{}" is no tag: wrapped, the tag is then "a{"
        ("a}b", "{a}b}"),
        ("open{", "{open{}"),
    ],
)
def test_tagged_prefixes_keep_every_extension_in_one_slot(prefix: str, expected: str) -> None:
    got = tagged(prefix)
    assert got == expected
    assert hash_tag(got + ":outcome:x{y}") == hash_tag(got + ":outcomes:pending") is not None


@pytest.mark.parametrize("bad", ["", "}", "}abc"])
def test_a_prefix_that_cannot_carry_a_tag_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        tagged(bad)

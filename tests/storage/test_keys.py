"""Key layout: versioned, hash-tagged, and refusing names that would break either."""

from __future__ import annotations

import pytest
from redis.cluster import key_slot

from cache_service.storage import keys


def test_keys_are_versioned_and_tagged() -> None:
    assert keys.log("acme/llama2") == "draftcache:v1:ns:{acme/llama2}:log"
    assert keys.session_keys("s1") == (
        "draftcache:v1:session:{s1}:state",
        "draftcache:v1:session:{s1}:rej",
    )
    assert keys.SCHEMA_VERSION == "draftcache:schema_version"
    assert keys.prior_part("n", 3, 0) == "draftcache:v1:ns:{n}:prior:3:0"


def test_a_namespace_and_a_session_each_live_in_one_cluster_slot() -> None:
    ns_keys = [keys.log("n"), keys.log_tokens("n"), keys.prior_current("n"), keys.prior_previous("n")]
    ns_keys += [keys.prior_seq("n"), keys.prior_meta("n", 7), keys.prior_part("n", 7, 3)]
    assert len({key_slot(k.encode()) for k in ns_keys}) == 1
    assert len({key_slot(k.encode()) for k in keys.session_keys("abc-123")}) == 1
    # The script that records a migration step under the lock touches both.
    assert key_slot(keys.MIGRATION_LOCK.encode()) == key_slot(keys.SCHEMA_VERSION.encode())


@pytest.mark.parametrize("bad", ["", "a{b", "a}b", "a b", "a*", "a?", "a[1]", "-lead", "x" * 129, "tab\t", "é"])
def test_bad_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        keys.log(bad)
    with pytest.raises(ValueError):
        keys.session_state(bad)


def test_longest_name_is_accepted() -> None:
    assert keys.check_name("x" * 128) == "x" * 128


def test_session_pattern_and_tag_round_trip() -> None:
    assert keys.session_state_pattern("ab*") == "draftcache:v1:session:{ab*}:state"
    assert keys.tag_of(keys.session_state("ab-1").encode()) == "ab-1"
    assert keys.tag_of(keys.log("acme/x")) == "acme/x"
    with pytest.raises(ValueError):
        keys.session_state_pattern("a{")
    with pytest.raises(ValueError):
        keys.tag_of("draftcache:schema_version")

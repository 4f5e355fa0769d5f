from cache_service.app import EARLY_REBUILD_GAP_S, SHARED_EARLY_REBUILD_GAP_S, early_rebuild_gap


def test_early_rebuilds_wait_twice_the_last_build_and_a_floor():
    # Nothing built yet: the first build may come at once.
    assert early_rebuild_gap(None, shared=False) == 0.0
    # Extending rebuilds are short: the one-second floor spaces them.
    assert early_rebuild_gap(0.2, shared=False) == EARLY_REBUILD_GAP_S == 1.0
    # A long build (a table due, a fresh sort) keeps rebuilds to a third of a core.
    assert early_rebuild_gap(3.0, shared=False) == 6.0
    # Shared generations are written whole to disk each time: a higher floor.
    assert early_rebuild_gap(0.2, shared=True) == SHARED_EARLY_REBUILD_GAP_S == 5.0
    assert early_rebuild_gap(4.0, shared=True) == 8.0

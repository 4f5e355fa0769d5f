"""Pure drafting algorithms over int32 token arrays: no I/O lives here.

The pieces, from storage to draft:

- :mod:`indexer.tokens` validates token arrays against a namespace's vocabulary.
- :mod:`indexer.lifetime_buffer` keeps every finished request in a fixed-size ring.
- :mod:`indexer.suffix_array` indexes a buffer snapshot for longest-match lookups.
- :mod:`indexer.ngram_table` holds frozen leader -> follower tables (lifetime and priors).
- :mod:`indexer.session_cache` holds the per-session dynamic and rejected LRU tables.
- :mod:`indexer.context_index` finds matches inside one request's own context.
- :mod:`indexer.tree_builder` merges candidates from all tiers into one budgeted tree.
- :mod:`indexer.drafter` ties them together per namespace and per session.
"""

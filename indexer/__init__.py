"""Pure drafting algorithms over int32 token arrays: no I/O lives here.

The pieces, from storage to draft:

- :mod:`indexer.tokens` validates token arrays against a namespace's vocabulary.
- :mod:`indexer.lifetime_buffer` keeps every finished request in a fixed-size ring.
- :mod:`indexer.suffix_array` indexes a buffer snapshot for longest-match lookups.
- :mod:`indexer.ngram_table` holds frozen leader -> follower tables (lifetime and priors);
  :mod:`indexer.prior` stacks several leader lengths into a static prior.
- :mod:`indexer.lifetime_index` is a namespace's cross-request memory: buffer, rebuilt indexes,
  delta index, exact-prompt cache.
- :mod:`indexer.session_cache` holds the per-session dynamic and rejected LRU tables.
- :mod:`indexer.context_index` finds matches inside one request's own context.
- :mod:`indexer.tree_builder` merges candidates from all tiers into one budgeted tree.
- :mod:`indexer.calibration` learns how far each tier's confidence can be trusted.
- :mod:`indexer.drafter` ties them together per namespace and per session.
- :mod:`indexer.prompt_lookup` is the classic baseline and the client's fallback drafter.
- :mod:`indexer.kernels` holds the compiled inner loops the modules above call.
"""

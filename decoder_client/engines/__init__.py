"""Draftcache inside inference engines: each module plugs the draft client into one engine's
own speculative-decoding hook (the engine is imported lazily, by that module alone)."""

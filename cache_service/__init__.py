"""The draftcache service: entry points, storage and the I/O around the pure indexer."""

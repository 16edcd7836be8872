"""KV caches: where the keys and values of past tokens live (chapter 04 naive, chapter 05 paged)."""

"""Chapter 17 — disaggregated serving: prefill and decode engines joined by a KV connector, and a KV-aware router."""

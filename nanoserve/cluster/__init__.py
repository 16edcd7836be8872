"""Chapter 16 — beyond one server: nanoserve replicas on Ray Serve, routed, autoscaled, observed."""

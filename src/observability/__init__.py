"""Observability: Prometheus metrics, the engine_stats logger, log set-up, log analysis and diagnosis."""

"""Test and soak tooling (fault injection, soak and hostile traffic, the float64 reference forward, quality checks): never imported by the serving path."""

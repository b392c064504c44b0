"""What a step hands back: responses built from a request's state, the per-iteration stats line, and the
step's output record. Imports only :mod:`bm.engine.requests` and :mod:`bm.engine.execution` of the
engine."""

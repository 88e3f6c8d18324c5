"""Gated DeltaNet reference, one module per face of the algorithm (see reference/__init__.py)."""

"""SymPy-checked algebra behind the chunked Gated DeltaNet kernels."""

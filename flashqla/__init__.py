"""flashqla: Gated DeltaNet chunked prefill for NVIDIA Hopper.

Public ops only. Importing this package never needs a GPU: kernels are built at their first launch.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

"""Tensor-parallel allreduce fused with residual add + RMSNorm, for PCIe-only GPU servers.

    FusedAllReduce          the communicator (fused_allreduce.py)
    python -m spec_kernels.comm.topo    measured GPU topology (P2P, NVLink, NUMA/PCIe, bandwidth)
    python -m spec_kernels.comm.tune    per-machine algorithm thresholds -> tuning JSON
"""
from .fused_allreduce import FusedAllReduce
from .selection import ALGORITHMS, TUNING_ENV, AlgorithmChoice

__all__ = ["FusedAllReduce", "AlgorithmChoice", "ALGORITHMS", "TUNING_ENV"]

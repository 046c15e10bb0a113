"""Benchmark result files: ``python -m spec_kernels.bench compare OLD.json NEW.json`` (see compare.py)."""

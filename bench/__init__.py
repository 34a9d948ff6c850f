"""Benchmarks, run from the repository root as ``python -m bench.<script>`` (docs/benchmarks.md)."""

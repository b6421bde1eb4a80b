"""fxpipe's benchmarks: each runs from the repository root as ``python -m benchmarks.NAME``."""

"""What the benchmarks share: output, memory readings, processes, oracles, model registries."""

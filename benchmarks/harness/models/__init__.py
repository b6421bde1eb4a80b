"""The models the benchmarks run: the sweeps' registry, the partition zoo, giant shapes."""

"""What the benchmarks share: their sizes and pipeline config, simulated engines and their traces, a stand-in
trainer, process-tree CPU and memory, and result files."""

"""Native kernels: CPU ops built on first use for the CPU at hand (cpu_build), GPU kernels later."""

"""tokenmill bench: workloads, the offline and HTTP load generators, metrics, reports and plots."""

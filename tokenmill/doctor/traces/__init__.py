"""The doctor's workloads read from traces: a trace the server recorded and the public production formats
(parsed into rows, then shaped into a workload the simulator replays); see load.py."""

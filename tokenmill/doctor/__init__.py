"""The doctor: questions about a workload answered from measurements (prompt redundancy first)."""

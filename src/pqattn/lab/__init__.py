"""The measurement lab: workloads, quality metrics, timing, and the CLI's commands."""

"""Ray actors and the Coordinator on real clusters: faults, resume, node pools, job submission, sweeps."""

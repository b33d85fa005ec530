"""The job file: job.yaml parsed and validated into a JobSpec."""

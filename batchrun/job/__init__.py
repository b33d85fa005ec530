"""The job side: a job file becomes a plan of work units, units become rows for the engine,
finished rows become committed Parquet parts (docs/ARCHITECTURE.md)."""

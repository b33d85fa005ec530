"""Helpers that the job side (batchrun/job) and the engine (batchrun/engine) both use. They sit
below both: nothing here imports either, so the engine never imports the job side."""

"""Running a worker: feeder, engine thread, writer, progress, interruption."""

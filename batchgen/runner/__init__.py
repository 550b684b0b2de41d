"""The job runner: supervisor (validate, launch, progress, finalize) and workers (engine + I/O)."""

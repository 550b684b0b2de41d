"""A worker rank's side of a job: the engine loop over its shard, intake, result lines,
in-flight checkpoints, quarantine and the watchdog."""

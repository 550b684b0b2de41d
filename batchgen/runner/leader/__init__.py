"""The leader's side of a job: the supervisor (scan, lock, preflight, launch, progress, finalize),
the multi-node group and its members, and the `status` / `validate` commands."""

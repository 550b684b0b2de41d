"""A job's on-disk state, shared by the leader and the workers: the job spec, its folders, the
job lock and the user-fixable errors they raise."""

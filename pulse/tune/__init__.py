"""The hybrid-parallelism tuner: PP x DP x microbatching x folds x schedule."""

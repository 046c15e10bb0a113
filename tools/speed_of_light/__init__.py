"""Speed-of-light model: predicted launch time from interpreter counters and per-GPU rates."""

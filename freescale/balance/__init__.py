"""Cost-balanced samples: the cost model, partition functions and the run-time balancer."""

"""The resume matrix (issue 24): stacks x loader set-ups x preemption points, see `harness`."""

"""``bm sweep``'s library side: the grid, the SLO search, the runner with its resume store, the outputs."""

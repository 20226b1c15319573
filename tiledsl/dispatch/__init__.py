"""What `tiledsl.attention` runs: the tuned tables, the automatic pick, the backward's choice, and the
autograd layer."""

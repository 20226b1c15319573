"""The scheduler graph of a spec (networkx), its passes, and the models read off it: HBM traffic, mask tiles,
split-KV, the cost model."""

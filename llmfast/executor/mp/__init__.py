"""The `mp` backend: one worker process per rank on this node, driven over socket pairs
(one message per step, pickled once for every rank)."""

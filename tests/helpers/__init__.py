"""What the tests share (import from here, never from another test module): tiny HF
checkpoints, tokenizers and chat models written on the spot, the paged and static-batch
model harnesses, engine workloads, and the reference SamplingMetadata builder."""

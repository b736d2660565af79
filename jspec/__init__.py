"""jspec: RL post-training with speculative decoding, JAX-first."""

"""RL post-training with an online co-trained draft: tasks and rewards (`tasks`), packed training
rows (`packing`), GRPO (`grpo`), the draft's training-time-test loss (`draft_loss`), the one-pytree
TrainState and the optimizer (`state`), its checkpoints (`checkpoints`), the jitted train step
(`train`), and where rollouts run with which weights (`rollouts`)."""

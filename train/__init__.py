"""Training for captioner: configs, the loop, the soft and hard (REINFORCE) objectives."""

"""The policy: engines, checkpoints, RSFT training and the weights' way from the Trainer to the PolicyServer."""

"""Loading a model onto its device and running its forward pass."""

"""Models as files: reading checkpoints without running what they name, writing quantized ones, and reparameterization."""

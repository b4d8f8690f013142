"""A QAT run end to end: the pipeline's stages, the run record (folder, checkpoints, report) and reports."""

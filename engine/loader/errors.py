class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture, tensor type or setting this engine cannot run."""

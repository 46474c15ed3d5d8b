"""The module inside DDP / FSDP / Float16 wrappers."""


def unwrap(model):
    """The GPTModel inside DDP / FSDP / Float16 wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model

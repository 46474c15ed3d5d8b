"""megatron-composer: a megatron-core trainer for the Composer 2 / 2.5 recipe."""
import warnings

# megatron-core announces every optional fused kernel it did not find (Apex,
# Transformer Engine) at import time; on CPU none of them exists by design.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
warnings.filterwarnings("ignore", message=r".*full scope is deprecated.*")

__version__ = "0.1.0"

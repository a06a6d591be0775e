"""ds4lab: the DeepSeek V4 Flash architecture, step by step, in a notebook."""

from .config import FLASH, NANO, ModelConfig, ModelFileError
from .engine import Model, default_model_path, load

__all__ = ["FLASH", "NANO", "Model", "ModelConfig", "ModelFileError", "default_model_path", "load"]
__version__ = "0.1.0"

"""ds4lab: the DeepSeek V4 Flash architecture, step by step, in a notebook."""

from .config import FLASH, NANO, PRO, ModelConfig, ModelFileError
from .engine import Model, default_model_path, load
from .kv.checkpoint import Checkpoint
from .kv.kvfile import KVFile, KVFileError
from .kv.store import KVStore, KVStoreWarning
from .session import Decode, DecodeStep, Prefill, PrefillChunk, Session
from .tiers import Placement, TierMemory, TierSwitch

__all__ = ["FLASH", "NANO", "PRO", "Checkpoint", "Decode", "DecodeStep", "KVFile", "KVFileError", "KVStore",
           "KVStoreWarning", "Model", "ModelConfig", "ModelFileError", "Placement", "Prefill", "PrefillChunk",
           "Session", "TierMemory", "TierSwitch", "default_model_path", "load"]
__version__ = "0.1.0"

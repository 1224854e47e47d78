"""Multi-LoRA serving, the adapter side: requests that name an adapter (``LoRARequest``), PEFT adapter folders
loaded and checked against the base model (``load_adapter``), and the device slot table the LoRA kernels read
(``LoRASlots``). The kernels themselves live in ``minfer/kernels/lora/``."""
from minfer.lora.adapter import LoRAAdapter, LoRAWeights, load_adapter, shard_weights
from minfer.lora.layout import FUSED_LAYERS, PROJECTIONS, BaseLinears
from minfer.lora.peft_config import LoRAAdapterError, PeftLoRAConfig
from minfer.lora.request import LoRARequest
from minfer.lora.slots import NO_SLOT, LoRASlots, LoRASlotsError, LoRAStack

__all__ = ["FUSED_LAYERS", "NO_SLOT", "PROJECTIONS", "BaseLinears", "LoRAAdapter", "LoRAAdapterError", "LoRARequest",
           "LoRASlots", "LoRASlotsError", "LoRAStack", "LoRAWeights", "PeftLoRAConfig", "load_adapter",
           "shard_weights"]

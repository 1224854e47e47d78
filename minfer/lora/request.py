"""LoRARequest: which adapter a request runs with (vLLM's class and field names)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter named by the caller. ``lora_int_id`` is the identity the engine keys everything by (slots,
    the CPU cache, a sequence's adapter), so it must be a positive int: 0 stays free to mean "no adapter"
    in per-row tensors. ``lora_path`` is a PEFT adapter folder, read only when the adapter is first loaded."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must be a non-empty string (an adapter folder), "
                             f"got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        """vLLM's generic adapter name for ``lora_int_id``."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

"""One rank's training engine: LoRA states (``lora``), micro-batches, gradient accumulation and the optimizer
(``engine``), torch.distributed / FSDP2 (``parallel``) and the FLOPs/MFU counter (``flops``)."""

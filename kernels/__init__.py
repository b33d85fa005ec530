"""Triton kernels, one op per module, torch references in `reference`.

Public entry points (import them from their modules; this package imports nothing so that
`reference` and `lora_meta` stay usable without triton and TRITON_INTERPRET can be set first):
  lora_meta.LoRAKernelMeta, lora_shrink.lora_shrink, lora_expand.lora_expand,
  paged_attention.paged_decode_attention, reference.ref_*.
"""

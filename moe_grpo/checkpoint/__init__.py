"""Checkpoints on disk: Hugging Face <-> megatron-core conversion, the streamed megatron reader, PEFT export, verification."""

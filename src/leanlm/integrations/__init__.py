"""leanlm inside other tools: transformers' quantizer API (`from_pretrained` of a leanlm checkpoint)."""

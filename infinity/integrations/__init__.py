"""Infinity inside other training tools: `hf` (the Hugging Face Trainer) and `sft` (TRL's
SFTTrainer). Each module imports its tool on use, so `import infinity` never needs them."""

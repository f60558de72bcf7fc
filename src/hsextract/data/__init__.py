"""What goes in: datasets and their records (JSONL, Parquet; chat or pre-tokenized), the chat template's
tokens and loss masks, which shard a sample belongs to, the model's config as read from its files, and the
host's cache of inputs staged from S3 or the orchestrator (with their manifests)."""

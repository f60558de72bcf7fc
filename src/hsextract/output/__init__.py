"""What comes out: the output format (batch files and their checksums, the per-shard journal, fp8 states),
the recipe an output holds, the uploads of a shard's files to S3, and fsck (what a crash or a disk left behind,
found and mended). The store the files go to is `hsextract.store`."""

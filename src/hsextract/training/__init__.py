"""The training side: reading an output back (`read_samples`, a torch Dataset, a streaming reader for many
workers) with its checksums checked, and exporting it to the layouts SpecForge and speculators load."""

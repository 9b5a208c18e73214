"""The foundation every layer may import: errors and exit codes, name
registries, config sections and their flags, the flag parser, logging
basics, files a job may trust, and torch.load of outside bytes.
Layer 1 of docs/design.md's map: imports nothing of HetSeq.
Tests: tests/unit/base/, tests/system/."""

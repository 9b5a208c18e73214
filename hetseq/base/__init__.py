"""The foundation every layer may import: errors and exit codes, name
registries, config sections and their flags, the flag parser, logging
basics, files a job may trust, and torch.load of outside bytes. It imports
nothing of HetSeq above it (docs/design.md, 'Layout')."""
